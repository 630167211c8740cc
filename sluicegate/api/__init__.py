"""The HTTP API's request checks and response formats, shared by ingress (online requests) and the batch service
(each line of a batch, judged and answered exactly as online): the OpenAI-compatible and native bodies, per-key
limits, errors in OpenAI's shape, building the pipeline's ``InferenceRequest``, tool calls, and OpenAI response
objects. Nothing here knows HTTP: ingress turns an :class:`~sluicegate.api.errors.ApiError` into its response.
"""
