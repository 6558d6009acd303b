"""What a newcomer trips on (issue 40), the items in the runtime's and the data path's files: the
API that takes a name returns the kind the name holds, and errors say why and point at the fix.
"""
from __future__ import annotations

import numpy as np
import pytest

import memsem
from memsem import AccessDeniedError, StateDictRef, TensorRef, WindowNotFoundError


@pytest.fixture
def rt():
    with memsem.Runtime(timeout=5) as r:
        yield r


def test_lookup_of_a_state_dicts_name_returns_a_state_dict_ref(rt):
    sd = {"w": np.arange(12, dtype=np.float32), "b": np.ones(3, np.int8)}
    pub = rt.publish_state_dict(sd, name="policy")
    with memsem.Runtime(timeout=5) as other:
        ref = other.lookup("policy")
        assert type(ref) is StateDictRef and ref.layout.names == pub.layout.names
        into = {k: np.zeros_like(v) for k, v in sd.items()}
        assert ref.load(into) == 1
        assert all((into[k] == v).all() for k, v in sd.items())
        assert type(other.ref(ref.to_bytes())) is StateDictRef  # bytes: the same kind


def test_lookup_of_a_plain_window_returns_a_tensor_ref(rt):
    rt.publish(np.arange(64, dtype=np.uint8), name="bytes")
    rt.publish(np.zeros(4, np.uint8), name="tiny")  # shorter than any state dict's header
    rt.publish(np.zeros(16, np.float32), name="floats")
    with memsem.Runtime(timeout=5) as other:
        for name in ("bytes", "tiny", "floats"):
            assert type(other.lookup(name)) is TensorRef, name


def test_a_put_through_a_read_only_ref_says_why(rt):
    ref = rt.publish(np.zeros(16, np.float32), slots=2)
    with memsem.Runtime(timeout=5) as other:
        r = other.ref(ref.to_bytes())
        with pytest.raises(AccessDeniedError) as ei:
            r.put(np.ones(16, np.float32))
        msg = str(ei.value)
        assert "read-only" in msg and "slots=2" in msg and "write section" in msg
        got = other.xcopy([(np.ones(16, np.float32), r)]).wait(5)[0]  # the same message on every path
        assert isinstance(got.error, AccessDeniedError) and "slots=2" in str(got.error)


def test_a_window_unpublished_here_is_not_a_job_question(rt):
    ref = rt.publish(np.zeros(16, np.float32), name="gone")
    rt.unpublish(ref)
    out = np.empty(16, np.float32)
    with pytest.raises(WindowNotFoundError) as ei:
        ref.get(out)
    msg = str(ei.value)
    assert "this runtime" in msg and "unpublished it" in msg and "MEMSEM_JOB" not in msg
