// Starts Swagger UI on /docs (app/api/dashboard.py) with FastAPI's settings. A file, not the
// inline script FastAPI's page has, so that the page's policy allows scripts from this
// service only (app/api/security_headers.py); the page's addresses come in data attributes.
const root = document.getElementById("swagger-ui");
window.ui = SwaggerUIBundle({
  url: root.dataset.openapiUrl,
  dom_id: "#swagger-ui",
  layout: "BaseLayout",
  deepLinking: true,
  showExtensions: true,
  showCommonExtensions: true,
  oauth2RedirectUrl: window.location.origin + root.dataset.oauth2RedirectUrl,
  presets: [SwaggerUIBundle.presets.apis, SwaggerUIBundle.SwaggerUIStandalonePreset],
});
