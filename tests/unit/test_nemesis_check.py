"""The nemesis checker on synthetic histories: a clean one passes; each kind of damage (lost, duplicated, a gap,
a mixed stream, a client that saw an event twice) fails with an account that names the request and the place."""

from __future__ import annotations

from benchmarks.nemesis_check import Entry, History, RequestHistory, check


def tokens(writer: str, epoch: int, seqs: range) -> list[Entry]:
    return [Entry(seq=s, type="token", writer=writer, epoch=epoch) for s in seqs]


def done(writer: str, epoch: int, seq: int, finish_reason: str = "length") -> Entry:
    return Entry(seq=seq, type="done", finish_reason=finish_reason, writer=writer, epoch=epoch)


def taken_over() -> RequestHistory:
    """w1 wrote seq 0..9 under epoch 1, then w2 took over (epoch 2) and finished: a clean resume."""
    entries = [*tokens("w1", 1, range(10)), *tokens("w2", 2, range(10, 20)), done("w2", 2, 20)]
    return RequestHistory(request_id="r-resumed", client="websocket", entries=entries, received_seqs=list(range(21)))


def clean_history() -> History:
    plain = RequestHistory(
        request_id="r-plain", client="openai_sse", entries=[*tokens("w1", 1, range(5)), done("w1", 1, 5)], results=1
    )
    cancelled = RequestHistory(
        request_id="r-cancel", client="native", entries=[*tokens("w2", 3, range(2)), done("w2", 3, 2, "abort")]
    )
    failed = RequestHistory(
        request_id="r-failed", client="kafka_native", entries=[Entry(seq=0, type="error", writer="w1", epoch=1)]
    )
    lapsed = RequestHistory(request_id="r-lapsed", client="openai_sse", lease_lapsed=True)
    return History(requests=[plain, taken_over(), cancelled, failed, lapsed])


def test_a_clean_history_passes_and_counts_every_outcome() -> None:
    verdict = check(clean_history())
    assert verdict.ok, verdict.account()
    assert verdict.outcomes == {"finished": 2, "cancelled": 2, "failed": 1}
    assert (verdict.lost, verdict.duplicated, verdict.mixed, verdict.gaps) == (0, 0, 0, 0)
    assert verdict.by_client == {"openai_sse": 2, "websocket": 1, "native": 1, "kafka_native": 1}


def test_a_request_without_an_end_is_lost_unless_its_reader_lease_lapsed() -> None:
    unfinished = RequestHistory(request_id="r-x", client="native", entries=tokens("w1", 1, range(4)))
    verdict = check(History(requests=[unfinished]))
    assert verdict.lost == 1 and verdict.outcomes == {"lost": 1}
    assert "r-x: lost: never finished (last seq 3)" in verdict.account()
    lapsed = unfinished.model_copy(update={"lease_lapsed": True})
    assert check(History(requests=[lapsed])).ok


def test_two_ends_or_entries_after_the_end_are_duplicates() -> None:
    twice = RequestHistory(
        request_id="r-2", client="native", entries=[*tokens("w1", 1, range(3)), done("w1", 1, 3), done("w2", 2, 4)]
    )
    after = RequestHistory(
        request_id="r-3", client="native", entries=[*tokens("w1", 1, range(3)), done("w1", 1, 3), *tokens("w1", 1, [4])]
    )
    verdict = check(History(requests=[twice, after]))
    assert verdict.duplicated == 2
    assert "r-2: duplicated: 2 ends: done at seq 3, done at seq 4" in verdict.account()
    assert "r-3: duplicated: 1 entries after its end" in verdict.account()


def test_a_seq_stored_twice_and_a_missing_seq_are_reported() -> None:
    entries = [*tokens("w1", 1, [0, 1, 1, 2, 5]), done("w1", 1, 6)]
    verdict = check(History(requests=[RequestHistory(request_id="r-g", client="native", entries=entries)]))
    assert (verdict.duplicated, verdict.gaps) == (1, 1)
    assert "seq [1] stored more than once" in verdict.account()
    assert "2 seqs missing: 3, 4" in verdict.account()


def test_an_older_epoch_after_a_newer_one_is_a_mixed_stream() -> None:
    # The zombie (w1, epoch 1) appended seq 13 after the new owner (w2, epoch 2) had appended 11 and 12.
    entries = [*tokens("w1", 1, range(11)), *tokens("w2", 2, [11, 12]), *tokens("w1", 1, [13]), done("w2", 2, 14)]
    request = RequestHistory(request_id="r-m", client="websocket", sampled=True, entries=entries)
    verdict = check(History(requests=[request]))
    assert (verdict.mixed, verdict.mixed_sampled, verdict.lost, verdict.duplicated) == (1, 1, 0, 0)
    assert "r-m: mixed: seq 13 by w1 (epoch 1) after seq 12 by w2 (epoch 2)" in verdict.account()


def test_one_epoch_with_two_writers_is_a_mixed_stream() -> None:
    entries = [*tokens("w1", 4, range(3)), *tokens("w2", 4, [3]), done("w1", 4, 4)]
    verdict = check(History(requests=[RequestHistory(request_id="r-e", client="native", entries=entries)]))
    assert verdict.mixed == 1
    assert "epoch 4 written by w1 and by w2 (seq 3)" in verdict.account()


def test_entries_without_an_epoch_are_counted_unattributed_not_passed_as_judged() -> None:
    entries = [Entry(seq=0, type="token"), Entry(seq=1, type="done", finish_reason="stop")]
    verdict = check(
        History(attribution="none", requests=[RequestHistory(request_id="r-u", client="native", entries=entries)])
    )
    assert verdict.ok and verdict.unattributed_entries == 2


def test_what_the_clients_saw_and_the_results_topic_are_checked_too() -> None:
    seen_twice = taken_over().model_copy(update={"received_seqs": [*range(12), 11, *range(12, 21)]})
    never_ended = RequestHistory(
        request_id="r-sse", client="openai_sse", entries=[done("w1", 1, 0)], client_finished=False, results=2
    )
    no_result = RequestHistory(request_id="r-nr", client="batch", entries=[done("w1", 1, 0)], results=0)
    verdict = check(History(requests=[seen_twice, never_ended, no_result]))
    account = verdict.account()
    assert "r-resumed: client_duplicated: client received seq [11] again" in account
    assert "r-sse: client_lost: openai_sse client never saw the end" in account
    assert "r-nr: no_result: no final result on llm.results" in account
    assert (verdict.duplicated, verdict.lost, verdict.result_duplicates) == (1, 1, 1)


def test_an_owner_continuing_a_stream_a_zombie_appended_to_after_its_pick_up_is_a_mixed_stream() -> None:
    # The zombie's seq 11 landed after w2's pick-up (epoch 2 begun) and before w2's first append: the epochs
    # still rise in seq order, but w2's seq 12 continues from its own seq 11, which is not in the stream.
    stale = Entry(seq=11, type="token", writer="w1", epoch=1, newest_epoch=2)
    entries = [*tokens("w1", 1, range(11)), stale, *tokens("w2", 2, [12]), done("w2", 2, 13)]
    request = RequestHistory(request_id="r-z", client="native", entries=entries)
    verdict = check(History(attribution="monitor", requests=[request]))
    assert (verdict.mixed, verdict.zombie_streams) == (1, 1)
    assert (
        "r-z: mixed: seq 12 by w2 (epoch 2) continues a stream that seq 11 by w1 (epoch 1) was appended to after "
        "epoch 2 began" in verdict.account()
    )


def test_a_zombie_append_no_newer_owner_continues_is_counted_but_leaves_one_writers_text() -> None:
    # w2 picked the request up (epoch 2) but lost it again before writing; w1 appended meanwhile and then picked it
    # up again itself (epoch 3, reading its own appends): one writer's text throughout.
    stale = [Entry(seq=s, type="token", writer="w1", epoch=1, newest_epoch=2) for s in (5, 6)]
    entries = [*tokens("w1", 1, range(5)), *stale, *tokens("w1", 3, [7]), done("w1", 3, 8)]
    request = RequestHistory(request_id="r-y", client="native", entries=entries)
    verdict = check(History(attribution="monitor", requests=[request]))
    assert verdict.ok and (verdict.mixed, verdict.zombie_streams) == (0, 1)
