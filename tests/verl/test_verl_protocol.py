"""The verl backend's slot-word protocol with its orders forced, in one process (no Ray): a
rollout that leaves the sync between the writer's look at its slot word and the writer's clear
of it is still reported, by name and message, never waited out to the timeout.

A writer (the trainer, or a relaying rollout) waits for word s of each rollout it sends to,
then clears it. A rollout that leaves marks "failed" and both slot words: when that lands
between the look and the clear, the clear erases the slot mark, and the final wait (on that
word) would see nothing until its timeout. Found in CI (a chain of 2, the relay failing as the
trainer cleared its word before the last bucket: MemsemTimeoutError after 120 s). The tests
make that moment happen on purpose, for each writer and each bucket slot.

Runs in .venv-verl (tests/verl/run_verl_tests.sh, ``make test-verl``).
"""
from __future__ import annotations

import asyncio

import pytest

import memsem
from memsem.integrations import verl as mv

BUCKET = 4096
TIMEOUT = 30.0  # a test that reaches it has failed (it takes well under a second when it passes)


def _engines(chain: int):
    """A trainer and ``chain`` rollouts, set up as verl does (prepare -> build_topology ->
    init_process_group), each with its own runtime on the local directory."""
    trainer = mv.MemsemCheckpointEngine(BUCKET, is_master=True, directory="local", timeout=TIMEOUT,
                                        meta_bytes=4096, fanout="chain")
    rollouts = [mv.MemsemCheckpointEngine(BUCKET, directory="local", timeout=TIMEOUT, meta_bytes=4096)
                for _ in range(chain)]
    everyone = [trainer] + rollouts
    try:
        metadata = [e.prepare() for e in everyone]
        actor, rollout = mv.MemsemCheckpointEngine.build_topology(1, chain, metadata)
        trainer.init_process_group(actor["rank"][0], actor["world_size"][0], actor["master_metadata"][0],
                                   rollouts=actor["rollouts"][0])
        for k, e in enumerate(rollouts):
            e.init_process_group(rollout["rank"][k], rollout["world_size"][k], rollout["master_metadata"][k],
                                 rollouts=rollout["rollouts"][k], upstream=rollout["upstream"][k])
    except BaseException:
        for e in everyone:
            e.close()
        raise
    return trainer, rollouts


def _leave_after_the_look(writer, reader, why: str) -> list[str]:
    """Make ``reader`` leave the sync right after ``writer``'s wait saw its slot word and before
    ``writer`` clears it. Returns the log of what happened, in order."""
    log: list[str] = []
    look = writer._await_words

    async def looked(*args, **kwargs):
        await look(*args, **kwargs)
        log.append("looked")
        reader._report_failure(why)
        log.append("left")

    writer._await_words = looked
    return log


@pytest.mark.parametrize("bucket", [0, 1, 2, 3])
@pytest.mark.parametrize("writer_is", ["trainer", "relay"])
def test_a_rollout_that_leaves_between_the_look_and_the_clear_is_reported(writer_is, bucket):
    trainer, rollouts = _engines(2)
    try:
        writer = trainer if writer_is == "trainer" else rollouts[0]
        reader = rollouts[0] if writer_is == "trainer" else rollouts[1]
        label = writer._rollouts[0][1]
        # the reader joined (both slot words) and, for bucket >= 2, copied bucket - 2 out of its slot
        reader._status.mark_ready(mv.W_SLOT0)
        reader._status.mark_ready(mv.W_SLOT1)

        async def run():
            loop = asyncio.get_running_loop()
            for b in range(bucket):  # the buckets before: plain waits and clears
                await writer._await_slot(loop, b)
                reader._status.mark_ready((mv.FIRST_BUCKET_VERSION + b) % 2)  # copied bucket b
            log = _leave_after_the_look(writer, reader, f"it failed: ValueError: consumer of bucket {bucket}")
            with pytest.raises(memsem.PeerLostError) as info:
                await writer._await_slot(loop, bucket)
            return log, info.value

        log, err = asyncio.run(run())
        assert log == ["looked", "left"], log  # the order was forced: the failure fell between
        text = str(err)
        assert label in text and "left the sync" in text, text
        assert f"ValueError: consumer of bucket {bucket}" in text, text
        # the slot word was cleared (the clear ran), the failure word stays
        slot = (mv.FIRST_BUCKET_VERSION + bucket) % 2
        assert not reader._status.is_ready(slot)
        assert reader._status.is_ready(mv.W_FAILED)
    finally:
        for e in [trainer] + rollouts:
            e.close()


def test_a_plain_look_and_clear_raises_nothing_and_clears_the_word():
    """The control: no failure, the same calls: the slot word is cleared and nothing raised
    (so the test above fails without the look after the clear)."""
    trainer, rollouts = _engines(1)
    try:
        st = rollouts[0]._status
        st.mark_ready(mv.W_SLOT0)
        st.mark_ready(mv.W_SLOT1)

        async def run():
            await trainer._await_slot(asyncio.get_running_loop(), 0)

        asyncio.run(run())
        assert not st.is_ready(mv.FIRST_BUCKET_VERSION % 2) and st.is_ready((mv.FIRST_BUCKET_VERSION + 1) % 2)
        assert not st.is_ready(mv.W_FAILED)
    finally:
        for e in [trainer] + rollouts:
            e.close()
