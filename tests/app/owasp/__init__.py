"""Security tests, one module per OWASP API Security Top 10 (2023) item they cover.

- API1 Broken Object Level Authorization: test_api1_object_level_authorization.py
- API2 Broken Authentication: test_api2_authentication_*.py (API keys; worker run tokens)
- API3 Broken Object Property Level Authorization: test_api3_property_level_authorization.py
  (what the service shows: secrets redacted everywhere)
- API4 Unrestricted Resource Consumption: test_api4_resource_consumption_*.py (request
  bounds, query parameters, uploads)
- API7 Server Side Request Forgery: test_api7_ssrf.py (model and dataset sources)
- API8 Security Misconfiguration: test_api8_security_misconfiguration.py

Every test here was written to fail on the code before issue 20's fixes.
"""
