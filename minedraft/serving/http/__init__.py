"""OpenAI-compatible HTTP front end: Starlette app (app.py), request/response shapes (openai_api.py),
Prometheus metrics (metrics.py), the dashboard page (static/), connection deadlines and cap (guard.py), and the
runner behind `serve --http` (serve.py)."""
