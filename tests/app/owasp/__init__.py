"""Security tests, one module per OWASP API Security Top 10 (2023) item and finding.

- API1 Broken Object Level Authorization: test_api1_object_level_authorization.py (uploads);
  test_api1_storage_paths.py (no request names another key's export or any storage path);
  test_api1_export_paths.py (a worker records only paths under its own run's folder; the
  model download follows no links)
- API2 Broken Authentication: test_api2_authentication_*.py (API keys; worker run tokens)
- API3 Broken Object Property Level Authorization: test_api3_property_level_authorization.py
  (what the service shows: secrets redacted everywhere); test_api3_queue_reasons.py (other
  keys' run ids never reach a tenant); test_api3_webhook_payloads.py (no hook URLs in
  payloads; each key's deliveries signed with its own secret)
- API4 Unrestricted Resource Consumption: test_api4_resource_consumption_*.py (request
  bounds, query parameters, uploads, profiles); test_api4_webhook_delivery_isolation.py (one
  tenant's bad or slow hooks do not stop another's deliveries)
- API5 Broken Function Level Authorization: test_api5_key_permissions.py (non-preemptible
  runs and tracking destinations as key permissions)
- API7 Server Side Request Forgery: test_api7_ssrf.py (model and dataset sources);
  test_api7_ssrf_webhooks.py (webhook destinations, checked at validation and at connect)
- API8 Security Misconfiguration: test_api8_security_misconfiguration.py;
  test_api8_content_security_policy.py; test_api8_nul_ids.py (malformed ids never reach the
  database)

Every test here was written to fail on the code before the fixes of the issue it names
(issue 20, and issue 39 for the tenant-isolation modules).
"""
