"""Writing a finished batch's output and error files in OpenAI's line format, in input order: a line that got a
response (``status_code`` 200 and exactly the ``chat.completion`` / ``text_completion`` object the online API
returns, built by :mod:`sluicegate.api.openai_format`) goes to the output file; every other line to the error file.
File ids derive from the batch id, so writing again after a crash replaces the same files.
"""

from __future__ import annotations

import anyio.to_thread

from router.heartbeats import read_heartbeats
from schemas import BatchLineError, BatchOutputLine, BatchResponse, ToolCallFormat, batch_request_id
from sluicegate.api.build import advertised_tool_call_format
from sluicegate.api.embeddings import embedding_response
from sluicegate.api.errors import error_body
from sluicegate.api.openai_choices import result_choices
from sluicegate.api.openai_format import ResponseIds
from sluicegate.batches.files import StoredFile, file_object
from sluicegate.batches.store import LineOutcome

from .prepare import PreparedLine, read_prepared
from .runtime import BatchRuntime

_GROUP = 1000


def output_line(
    batch_id: str, line: PreparedLine, outcome: LineOutcome, endpoint: str, fmt: ToolCallFormat | None = None
) -> BatchOutputLine:
    """The output or error file line of one input line; ``fmt`` is how its model writes tool calls (if known)."""
    request_id = batch_request_id(batch_id, line.line)
    line_id = f"batch_req_{request_id.replace('-', '_')}"
    if outcome.no_response:
        error = BatchLineError(code=outcome.code or "batch_failed", message=outcome.message or "")
        return BatchOutputLine(id=line_id, custom_id=line.custom_id, error=error)
    if outcome.succeeded and endpoint == "/v1/embeddings" and outcome.result and outcome.result.embedding is None:
        outcome = LineOutcome(status_code=500, code="worker_error", message="The worker answered without a vector.")
    if outcome.succeeded:
        assert outcome.result is not None
        result = outcome.result
        # A line naming a LoRA adapter reports the adapter's name, as the online API answers it.
        model = line.request.adapter if line.request is not None and line.request.adapter else result.model
        if endpoint == "/v1/embeddings":
            encoding = line.encoding_format or "float"
            body = embedding_response(model, [result.embedding], result.usage.prompt_tokens, encoding)
        else:
            kind = "chat" if endpoint == "/v1/chat/completions" else "completion"
            ids = ResponseIds(kind, request_id, model, int(result.created_at.timestamp()))
            logprobs = line.request is not None and line.request.sampling.logprobs is not None
            tools = line.tools.plan(fmt) if line.tools is not None else None
            body = ids.choices_response(result_choices(kind, result, logprobs, tools), result.usage)
        response = BatchResponse(status_code=200, request_id=request_id, body=body)
    else:
        body = error_body(outcome.message or "", type_=_error_type(outcome), param=outcome.param, code=outcome.code)
        response = BatchResponse(status_code=outcome.status_code, request_id=request_id, body=body)
    return BatchOutputLine(id=line_id, custom_id=line.custom_id, response=response)


async def _tool_call_format(
    runtime: BatchRuntime, model: str, known: dict[str, ToolCallFormat | None]
) -> ToolCallFormat | None:
    """The tool-call format ``model``'s live workers advertise, read once per model and output; None (each
    format is tried) when no worker is live any more."""
    if model not in known:
        beats = await read_heartbeats(
            runtime.redis, runtime.names, model, max_age_s=3 * runtime.settings.heartbeat_interval_s
        )
        known[model] = advertised_tool_call_format(beats)
    return known[model]


def _error_type(outcome: LineOutcome) -> str:
    if outcome.code == "insufficient_quota":  # OpenAI's type for it, as ingress answers it
        return "insufficient_quota"
    return "server_error" if outcome.status_code >= 500 else "invalid_request_error"


def output_file_ids(batch_id: str) -> tuple[str, str]:
    """The ids of a batch's output and error files."""
    token = batch_id.removeprefix("batch_")
    return f"file-{token}out", f"file-{token}err"


async def write_outputs(
    runtime: BatchRuntime, batch_id: str, tenant: str, endpoint: str
) -> tuple[str | None, str | None]:
    """Write the output and error files from the stored outcomes; a line with none gets a ``fallback`` error
    (the caller resolves every line first). Returns (output file id, error file id), None for an empty file."""
    files = runtime.files
    lines = await anyio.to_thread.run_sync(read_prepared, files, batch_id)
    out_id, err_id = output_file_ids(batch_id)
    out_path, err_path = files.path_for(out_id), files.path_for(err_id)
    counts = {"out": 0, "err": 0}
    formats: dict[str, ToolCallFormat | None] = {}  # model -> how its workers write tool calls
    with files.open_write(out_path) as out, files.open_write(err_path) as err:
        for start in range(0, len(lines), _GROUP):
            group = lines[start : start + _GROUP]
            outcomes = await runtime.batches.outcomes(batch_id, [p.line for p in group])
            out_data, err_data = [], []
            for prepared, outcome in zip(group, outcomes, strict=True):
                if outcome is None:
                    outcome = LineOutcome(code="batch_failed", message="The line has no result.", no_response=True)
                fmt = None
                if prepared.tools is not None and outcome.result is not None:
                    fmt = await _tool_call_format(runtime, outcome.result.model, formats)
                text = output_line(batch_id, prepared, outcome, endpoint, fmt).model_dump_json().encode() + b"\n"
                if outcome.succeeded:
                    out_data.append(text)
                else:
                    err_data.append(text)
            counts["out"] += len(out_data)
            counts["err"] += len(err_data)
            await anyio.to_thread.run_sync(out.write, b"".join(out_data))
            await anyio.to_thread.run_sync(err.write, b"".join(err_data))
    result: list[str | None] = []
    for file_id, path, name, kind in ((out_id, out_path, "output", "out"), (err_id, err_path, "errors", "err")):
        if counts[kind] == 0:
            await anyio.to_thread.run_sync(files.remove, path)
            result.append(None)
            continue
        size = await anyio.to_thread.run_sync(files.size, path)
        stored = StoredFile(
            file=file_object(file_id, size=size, filename=f"{batch_id}_{name}.jsonl", purpose="batch_output"),
            tenant=tenant,
            path=path,
            lines=counts[kind],
        )
        await files.register(stored)
        result.append(file_id)
    return result[0], result[1]
