"""``python -m result_service``: serve the result service with settings from the environment."""

from sluicegate.logs import configure_logging
from sluicegate.settings import ResultServiceSettings

from .server import serve

if __name__ == "__main__":
    settings = ResultServiceSettings()
    configure_logging(settings.log_level, settings.log_format)
    serve(settings)
