"""What every settings concern shares: where values come from (``SLUICEGATE_<FIELD>`` variables) and the
parsing helper for comma-separated values.

Each concern of :mod:`sluicegate.settings` is a subclass of :class:`SettingsBase`, so a service's settings class
composed from several concerns reads every one of its variables the same way.
"""

from __future__ import annotations

from pydantic_settings import BaseSettings, SettingsConfigDict


class SettingsBase(BaseSettings):
    """The environment source of every concern: prefix ``SLUICEGATE_``, and variables a class does not declare
    ignored (each service reads only its own, beside the variables of the others in one environment)."""

    model_config = SettingsConfigDict(env_prefix="SLUICEGATE_", extra="ignore")


def comma_separated(text: str) -> list[str]:
    """A comma-separated setting's items in order, each stripped, blanks dropped (``" a, ,b "`` -> ``["a", "b"]``)."""
    return [item.strip() for item in text.split(",") if item.strip()]
