"""Pydantic v2 message contracts shared by every Sluicegate service and outside producer; topic and key names live in `schemas.names`."""
