"""``python -m result_service``: serve the result service with settings from the environment."""

from sluicegate.logs import configure_logging
from sluicegate.settings import get_settings

from .server import serve

if __name__ == "__main__":
    settings = get_settings()
    configure_logging(settings.log_level, settings.log_format)
    serve(settings)
