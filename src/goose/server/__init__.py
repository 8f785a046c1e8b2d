"""`goose serve`: an OpenAI-compatible HTTP server over `goose.Engine`, with Prometheus metrics and a web
playground (docs/serving.md). `create_app` and `serve` live in `goose.server.app` (imported on use, so the
command line does not load FastAPI for other commands)."""


def __getattr__(name: str):
    if name in ("create_app", "serve"):
        from . import app

        return getattr(app, name)
    raise AttributeError(name)
