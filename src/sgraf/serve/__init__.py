"""`sgraf serve`: gallery search as a web page and an HTTP API (the `serve` extra).

- `service.SearchService`: the work, as plain functions over an opened index (search, explain,
  health, the checks of every argument, where pictures may be read from).
- `worker.Worker`: the threads that run the models (one by default, `serve --workers N`);
  text searches that wait together are scored as one batch; a bounded queue refuses work when full.
- `app.create_app(service)`: the FastAPI application, thin routes over the two.
- `models`: the JSON answers' shapes, for the OpenAPI schema.
- `static/`: the web page (HTML, script, style), shipped with the package: nothing is fetched
  from elsewhere.

Importing this package imports neither FastAPI nor uvicorn; `sgraf.serve.app` does.
"""
