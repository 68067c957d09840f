"""The `tuneyard` command line."""

from __future__ import annotations

import logging
from typing import Any

import typer

from app.settings import Settings

app = typer.Typer(help="tuneyard: fine-tune language models on Ray Train + DeepSpeed over HTTP.")
keys_app = typer.Typer(help="Manage API keys.")
app.add_typer(keys_app, name="keys")


def _configure_logging() -> None:
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )


@app.command()
def serve(
    host: str = typer.Option(None, help="Bind address (default 127.0.0.1)."),
    port: int = typer.Option(None, help="Port (default 8000)."),
) -> None:
    """Run the service; with no TUNEYARD_RAY_ADDRESS it starts and stops a local Ray head."""
    import uvicorn

    from app.main import create_app

    _configure_logging()
    overrides: dict[str, Any] = {
        k: v for k, v in {"host": host, "port": port}.items() if v is not None
    }
    settings = Settings(**overrides)
    uvicorn.run(create_app(settings), host=settings.host, port=settings.port, log_level="info")


@keys_app.command("create")
def keys_create(name: str = typer.Option(..., "--name", help="Who the key is for.")) -> None:
    """Create an API key and print it (it is shown only once)."""
    from app.db import make_engine, make_session_factory, transaction
    from app.migrate import upgrade_database
    from app.services.api_keys import create_api_key

    settings = Settings()
    upgrade_database(settings.resolved_database_url)
    engine = make_engine(settings.resolved_database_url)
    with transaction(make_session_factory(engine)) as session:
        _, secret = create_api_key(session, name=name)
    engine.dispose()
    typer.echo(secret)


@app.command()
def demo(
    steps: int = typer.Option(30, help="Training steps of the demo run."),
    port: int = typer.Option(None, help="Port for the demo service (default: a free one)."),
) -> None:
    """Offline demo: start the service, fine-tune a tiny local GPT-2 over HTTP, show the result."""
    from app.demo import run_demo

    raise typer.Exit(run_demo(steps=steps, port=port))


def main() -> None:
    app()
