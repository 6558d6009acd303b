"""Hostile or corrupted input (issue 12 §6): wire forms, directory records, descriptors and numeric
arguments are validated at the door, with a ValueError/TypeError that names the field, before
anything is allocated or waited for.
"""
from __future__ import annotations

import math
import pickle
import struct
import tracemalloc
import types

import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

import memsem
from memsem import FieldRef, FieldSet, MemsemError, MemsemTimeoutError, TensorRef
from memsem.engines import Descriptor, HostEngine
from memsem.engines.loopback import LoopbackEngine
from memsem.gva import RefSpec, WindowInfo

KEY = bytes(range(16))


def _spec(**change):
    fields = dict(gva=1 << 44 | 1 << 16, generation=7, key=KEY, access="rw", offset=0, nbytes=32,
                  dtype_code=memsem._dtypes.code_of("float64"), shape=(4,), byte_offset=0,
                  framework="numpy", name="w")
    fields.update(change)
    return RefSpec(**fields)


# -- RefSpec: construction -----------------------------------------------------------------------
@pytest.mark.parametrize("change, exc, field", [
    (dict(offset=-1), ValueError, "offset"),
    (dict(offset=1 << 63), ValueError, "offset"),
    (dict(offset=(1 << 63) - 8), ValueError, r"offset \+ nbytes"),
    (dict(nbytes=-32), ValueError, "nbytes"),
    (dict(nbytes=33), ValueError, "nbytes is 33"),
    (dict(shape=(5,)), ValueError, r"shape \(5,\)"),
    (dict(shape=(2, -2)), ValueError, r"shape\[1\]"),
    (dict(shape=(4.0,)), TypeError, r"shape\[0\]"),
    (dict(shape=(True, 4)), TypeError, r"shape\[0\]"),
    (dict(shape=(1,) * 65, nbytes=8), ValueError, "dimensions"),
    (dict(shape="4"), TypeError, "shape"),
    (dict(gva=-1), ValueError, "gva"),
    (dict(gva=1 << 64), ValueError, "gva"),
    (dict(generation=1.5), TypeError, "generation"),
    (dict(generation=True), TypeError, "generation"),
    (dict(key=b"short"), ValueError, "key must be 16 bytes"),
    (dict(key="0123456789abcdef"), TypeError, "key"),
    (dict(access="w"), ValueError, "access"),
    (dict(dtype_code=0), ValueError, "dtype_code"),
    (dict(dtype_code=200), ValueError, "dtype_code"),
    (dict(dtype_code=None), TypeError, "dtype_code"),
    (dict(byte_offset=-1), ValueError, "byte_offset"),
    (dict(byte_offset=1 << 32), ValueError, "byte_offset"),
    (dict(framework="jax"), ValueError, "framework"),
    (dict(name=b"w"), TypeError, "name"),
    (dict(name="é" * 200), ValueError, "name must be at most 255"),
])
def test_refspec_refuses_bad_fields(change, exc, field):
    with pytest.raises(exc, match=field):
        _spec(**change)


def test_refspec_accepts_numpy_ints_and_normalizes_them():
    s = _spec(offset=np.int64(8), nbytes=np.uint32(16), shape=[np.int32(2)])
    assert s.offset == 8 and type(s.offset) is int and s.shape == (2,) and type(s.shape[0]) is int
    assert RefSpec.from_bytes(s.to_bytes()) == s


def test_repr_hides_the_access_key(rt):
    ref = rt.publish(np.zeros(8, np.float32), name="secret")
    fs = rt.publish_fields({"x": np.zeros((4, 2), np.float32)}, name="fs")
    key = ref.spec.key
    for text in (repr(ref.spec), str(ref.spec), repr(ref), repr(fs), repr(fs["x"]), repr(fs["x"].spec)):
        assert key.hex() not in text and repr(key) not in text and str(list(key)) not in text, text
        assert key.hex()[:8] not in text
    assert "hidden" in repr(ref.spec)
    assert ref.spec.key_hint in repr(ref.spec)  # identifies the key without revealing it


# -- RefSpec: wire form --------------------------------------------------------------------------
def _wire(spec: RefSpec) -> bytearray:
    return bytearray(spec.to_bytes())


def _set(b, fmt: str, at: int, value) -> bytes:
    b = bytearray(b)
    struct.pack_into(fmt, b, at, value)
    return bytes(b)


@pytest.mark.parametrize("mutate, field", [
    (lambda b: _set(b, "<B", 4, 0x80), "unknown flag bits 0x80"),
    (lambda b: _set(b, "<B", 4, 2 | 4), "two frameworks"),
    (lambda b: _set(b, "<B", 5, 0), "dtype_code 0"),
    (lambda b: _set(b, "<B", 5, 99), "dtype_code 99"),
    (lambda b: _set(b, "<B", 6, 200), "ndim 200 exceeds"),
    (lambda b: _set(b, "<B", 6, 2), "header"),
    (lambda b: _set(b, "<B", 7, 9), "header"),
    (lambda b: _set(b, "<Q", 48, 1 << 42), "nbytes"),                     # nbytes disagrees with shape
    (lambda b: _set(b, "<Q", 60, 1 << 40), r"shape"),                     # 8 TiB shape, 32 bytes
    (lambda b: _set(b, "<Q", 40, (1 << 64) - 8), "offset"),               # offset overflows
    (lambda b: _set(_set(_set(b, "<Q", 48, (1 << 63) - 8), "<Q", 60, ((1 << 63) - 8) // 8), "<Q", 40, 16),
     r"offset \+ nbytes = 16 \+ 9223372036854775800 overflows"),
    (lambda b: bytes(b[:-1]) + b"\xff", "name is not UTF-8"),
    (lambda b: bytes(b[:30]), "not a serialized memsem ref"),
    (lambda b: bytes(b[:-2]), "header"),
    (lambda b: bytes(b) + b"\0", "header"),
    (lambda b: b"MSR2" + bytes(b[4:]), "not a serialized memsem ref"),
])
def test_from_bytes_refuses_corruption_naming_the_field(mutate, field):
    with pytest.raises(ValueError, match=field):
        RefSpec.from_bytes(mutate(_wire(_spec())))


def test_from_bytes_refuses_non_bytes():
    with pytest.raises(TypeError, match="data must be bytes"):
        RefSpec.from_bytes("MSR1")


def test_shape_disagreeing_with_nbytes_never_allocates(rt):
    """The example of the issue: a 4 TiB shape on a 32-byte ref raised MemoryError in get()."""
    ref = rt.publish(np.arange(4, dtype=np.float64))
    bad = _set(_wire(ref.spec), "<Q", 60, 1 << 39)
    with pytest.raises(ValueError, match="shape"):
        TensorRef.from_bytes(bad, rt)


def test_forged_ref_is_checked_before_the_destination_is_allocated(rt):
    """A self-consistent forged ref (shape x itemsize == nbytes, 1 GiB) with a wrong key: get()
    resolves (AccessDeniedError) before allocating the gigabyte."""
    ref = rt.publish(np.arange(4, dtype=np.float64))
    n = 1 << 30
    s = ref.spec
    forged = TensorRef(RefSpec(s.gva, s.generation, bytes(16), s.access, 0, n, s.dtype_code, (n // 8,)), rt)
    tracemalloc.start()
    try:
        for call in (forged.get, lambda: forged.get(framework="dlpack"), forged.get_async):
            with pytest.raises(memsem.AccessDeniedError):
                call()
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20, f"{peak} bytes allocated before the key check"
    genuine_key_too_long = TensorRef(RefSpec(s.gva, s.generation, s.key, s.access, 0, n, s.dtype_code,
                                             (n // 8,)), rt)
    with pytest.raises(ValueError, match="lies outside"):
        genuine_key_too_long.get()


# -- hypothesis: mutated wire forms give ValueError or a self-consistent ref ---------------------
def _mutations(n: int):
    pos = st.integers(0, max(0, n - 1))
    return st.lists(st.one_of(
        st.tuples(st.just("truncate"), pos),
        st.tuples(st.just("set"), pos, st.integers(0, 255)),
        st.tuples(st.just("splice"), st.integers(0, n), st.binary(max_size=12)),
        st.tuples(st.just("u64"), st.integers(0, max(0, n - 8)), st.integers(0, (1 << 64) - 1)),
    ), min_size=1, max_size=3)


def _apply(data: bytes, muts) -> bytes:
    b = bytearray(data)
    for m in muts:
        if m[0] == "truncate":
            del b[m[1]:]
        elif m[0] == "set" and m[1] < len(b):
            b[m[1]] = m[2]
        elif m[0] == "splice":
            b[m[1]:m[1]] = m[2]
        elif m[0] == "u64" and m[1] + 8 <= len(b):
            struct.pack_into("<Q", b, m[1], m[2])
    return bytes(b)


@pytest.fixture(scope="module")
def wires():
    """Real serialized refs and field sets of a live runtime (module-scoped for hypothesis)."""
    import os
    import secrets

    rt = memsem.Runtime(timeout=5.0, job=f"hyp{os.getpid()}-{secrets.token_hex(3)}")
    try:
        w = rt.publish(np.arange(64, dtype=np.float32).reshape(8, 8), name="weights", tiles=4)
        fs = rt.publish_fields({"prompts": np.arange(24, dtype=np.int32).reshape(6, 4),
                                "rewards": np.ones(6, np.float16)}, tile_rows=2, name="batch")
        yield rt, {"ref": w.to_bytes(), "sub": w.bytes(8, 40).to_bytes(), "field": fs["prompts"].to_bytes(),
                   "set": fs.to_bytes()}, w.nbytes
    finally:
        rt.close()


_PARSERS = {"ref": TensorRef.from_bytes, "sub": TensorRef.from_bytes, "field": FieldRef.from_bytes,
            "set": FieldSet.from_bytes}


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_mutated_wire_forms_parse_or_raise_valueerror(wires, data):
    rt, blobs, window_bytes = wires
    kind = data.draw(st.sampled_from(sorted(blobs)))
    raw = blobs[kind]
    mutated = _apply(raw, data.draw(_mutations(len(raw))))
    try:
        obj = _PARSERS[kind](mutated, rt)
    except ValueError:
        event("refused by the parser")
        return  # the only failure a parser may raise
    event("parsed")
    refs = list(obj.values()) if isinstance(obj, FieldSet) else [obj]
    for r in refs:
        s = r.spec
        itemsize = memsem._dtypes.numpy_dtype(s.dtype_code).itemsize
        assert math.prod(s.shape) * itemsize == s.nbytes  # what get() allocates is nbytes
        assert 0 <= s.offset and s.offset + s.nbytes < 1 << 63
        tracemalloc.start()
        try:
            try:
                got = r.get()
            except (MemsemError, ValueError) as exc:
                event(f"get refused: {type(exc).__name__}")
            else:
                event("get returned")
                assert got.nbytes == s.nbytes
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert peak <= window_bytes + (256 << 10), f"get() of a mutated ref allocated {peak} bytes"


@settings(max_examples=150, deadline=None)
@given(cut=st.integers(0, 400))
def test_truncated_fieldset_and_pickles_raise_valueerror(cut):
    spec = _spec(nbytes=48, shape=(6, 1), name="b/x")
    fs = FieldSet("b", [FieldRef(spec, field="x", tile_rows=2), FieldRef(_spec(gva=2 << 44, nbytes=48, shape=(6,), name="b/y"),
                                                                          field="y", tile_rows=3)])
    data = fs.to_bytes()
    if cut >= len(data):
        assert FieldSet.from_bytes(data) == fs
        return
    with pytest.raises(ValueError):
        FieldSet.from_bytes(data[:cut])
    fn, args = fs["x"].__reduce__()
    body = args[0]
    if cut < len(body):
        with pytest.raises(ValueError):
            fn(body[:cut])
    # the same through pickle (what a worker unpickling a batch runs)

    class Corrupt:
        def __reduce__(self):
            return FieldSet.from_bytes, (data[:cut],)

    with pytest.raises(ValueError):
        pickle.loads(pickle.dumps(Corrupt()))


@pytest.mark.parametrize("mutate, field", [
    (lambda d: d[:4], "truncated: version"),
    (lambda d: d[:4] + b"\x09" + d[5:], "version 9"),
    (lambda d: d[:5] + b"\xff" + d[6:], "truncated|field"),
    (lambda d: d[:6] + b"\xff" + d[7:], "name is not UTF-8"),
    (lambda d: d[:7] + b"\0\0" + d[9:], "field count is 0"),
    (lambda d: d[:7] + b"\x09\0" + d[9:], "truncated: length of field"),
    (lambda d: d[:9] + b"\xff\xff\xff\x00" + d[13:], "truncated: field 0"),
    (lambda d: d + b"x", "contents end at"),
])
def test_fieldset_from_bytes_names_the_field(mutate, field):
    fs = FieldSet("b", [FieldRef(_spec(nbytes=48, shape=(6, 1)), field="x", tile_rows=2)])
    with pytest.raises(ValueError, match=field):
        FieldSet.from_bytes(mutate(fs.to_bytes()))


def test_fieldref_from_bytes_names_the_field():
    fr = FieldRef(_spec(nbytes=48, shape=(6, 1)), field="x", tile_rows=2)
    b = fr.to_bytes()
    with pytest.raises(ValueError, match="tile_rows"):
        FieldRef.from_bytes(b[:4] + b"\0\0\0\0" + b[8:])            # tile_rows 0
    with pytest.raises(ValueError, match="field name is not UTF-8"):
        FieldRef.from_bytes(b[:9] + b"\xff" + b[10:])
    with pytest.raises(ValueError, match="truncated: tile_rows"):
        FieldRef.from_bytes(b[:6])
    with pytest.raises(ValueError, match="field name"):
        FieldRef.from_bytes(b[:8] + b"\xff" + b[9:])                # name length past the end


def test_fieldref_whose_tiling_disagrees_with_the_window_is_refused(rt):
    """A FieldRef with a forged tile_rows would wait for too few ready words and read rows that
    are not ready: refused before waiting or marking."""
    fs = rt.publish_fields({"x": ((8, 2), np.float32)}, tile_rows=2, name="t")
    forged = FieldRef(fs["x"].spec, rt, field="x", tile_rows=8)
    fs["x"].put_rows(0, np.ones((2, 2), np.float32))  # marks tile 0 only
    for call in (lambda: forged.wait_rows(0, 8, timeout=0.1), lambda: forged.rows_ready(0, 8),
                 lambda: forged.get_rows(0, 8, timeout=0.1), lambda: forged.mark_rows(0, 8),
                 lambda: FieldSet("t", [forged], rt).wait(timeout=0.1),
                 lambda: list(FieldSet("t", [forged], rt).tile_events(timeout=0.1))):
        with pytest.raises(ValueError, match="tile_rows=8 gives 1 tiles"):
            call()


# -- directory records and descriptors -----------------------------------------------------------
def _record(rt) -> dict:
    ref = rt.publish(np.arange(16, dtype=np.float32), name="rec")
    return rt.publisher.owned[ref.spec.gva].info.to_json(), ref


@pytest.mark.parametrize("mutate, field", [
    (lambda d: d.pop("descriptors"), "no field 'descriptors'"),
    (lambda d: d.update(descriptors=[]), "'descriptors' must be dict"),
    (lambda d: d.update(nbytes="64"), "'nbytes' must be int"),
    (lambda d: d.update(nbytes=True), "'nbytes' must be int"),
    (lambda d: d.update(generation=-3), "'generation' must be >= 0"),
    (lambda d: d.update(access="x"), "'access'"),
    (lambda d: d.update(shape=[4, "x"]), "'shape'"),
    (lambda d: d.update(shape=7), "'shape' must be list or tuple"),
    (lambda d: d.update(dtype_code=99), "dtype_code"),
    (lambda d: d.pop("gva"), "no field 'gva'"),
    (lambda d: d.update(owner_pid=None), "no field 'owner_pid'"),
    (lambda d: d["descriptors"].update(host=["x"]), r"'descriptors'\['host'\].*JSON object"),
    (lambda d: d["descriptors"].update(host={"engine": "host"}), r"'descriptors'\['host'\].*no field 'fields'"),
    (lambda d: d["descriptors"].update(host={"engine": 5, "fields": {}}), r"'engine' must be str"),
    (lambda d: d["descriptors"].update(host=dict(d["descriptors"]["loopback"])), "tagged for engine 'loopback'"),
])
def test_window_record_refused_naming_the_field(rt, mutate, field):
    rec, _ = _record(rt)
    mutate(rec)
    with pytest.raises(ValueError, match=field):
        WindowInfo.from_json(rec)


def test_window_record_not_an_object():
    for bad in ([], "x", None, 3):
        with pytest.raises(ValueError, match="window record must be a JSON object"):
            WindowInfo.from_json(bad)


def test_corrupt_directory_record_gives_valueerror_through_get(rt):
    """A consumer resolving a window whose directory record lost its descriptors (or whose host
    descriptor holds another engine's fields) gets a ValueError naming the field."""
    rec, ref = _record(rt)
    with memsem.Runtime(timeout=5.0, engines=["host"]) as consumer:  # route host, not loopback
        cref = consumer.ref(ref.to_bytes())
        for mutate, field in ((lambda d: d.pop("descriptors"), "descriptors"),
                              (lambda d: d["descriptors"].update(
                                  host={"engine": "host", "fields": d["descriptors"]["loopback"]["fields"]}),
                               "host descriptor has no field 'kind'")):
            bad = {**rec, "descriptors": {k: dict(v) for k, v in rec["descriptors"].items()}}
            mutate(bad)
            rt.directory.put_window(ref.spec.gva, "rec", bad)
            consumer.resolver.close(0)
            with pytest.raises(ValueError, match=field):
                cref.get()
        rt.directory.put_window(ref.spec.gva, "rec", rec)
        consumer.resolver.close(0)
        assert (cref.get() == np.arange(16, dtype=np.float32)).all()


def test_garbage_directory_file_gives_valueerror_naming_it(rt):
    ref = rt.publish(np.zeros(4, np.float32))
    import os

    with memsem.Runtime(timeout=5.0) as consumer:
        path = os.path.join(rt.directory.path, f"w.{ref.spec.gva:016x}")
        for garbage in (b"{not json", b"[1, 2]", b'{"gva": "x"}', b"\xff\xfe"):
            with open(path, "wb") as f:
                f.write(garbage)
            consumer.resolver.close(0)
            with pytest.raises(ValueError, match=f"w.{ref.spec.gva:016x}"):
                consumer.ref(ref.to_bytes()).get()
        assert all(isinstance(w, dict) for w in consumer.directory.windows())


def _other_engines_fields():
    return {
        "host": {"pid": 1, "address": 4096, "writable": True, "token": "ab"},      # loopback's
        "loopback": {"kind": "shm", "segment": "memsem.x", "offset": 0},            # host's
        "tcp": {"team": "t", "pe": 0, "offset": 0},                                 # mte's
        "rdma": {"endpoint": "tcp://127.0.0.1:1"},                                  # tcp's
        "mte": {"ep": "e", "reg": 1, "addr": 0, "nbytes": 64, "mrs": []},           # rdma's
    }


def _stub(name: str, **attrs):
    return types.SimpleNamespace(name=name, _check_descriptor=lambda d: None, _check_open=lambda: None,
                                 _check_usable=lambda: None, **attrs)


@pytest.mark.parametrize("engine", ["host", "loopback", "tcp", "rdma", "mte"])
def test_descriptor_with_another_engines_fields_names_the_field(engine):
    """The right engine tag with another engine's fields: a ValueError naming the missing field
    from attach (and deregister), never a bare KeyError."""
    desc = Descriptor(engine, _other_engines_fields()[engine])
    if engine == "host":
        attach, dereg = HostEngine().attach, None
    elif engine == "loopback":
        eng = LoopbackEngine()
        attach, dereg = eng.attach, eng.deregister
    elif engine == "tcp":
        from memsem.engines.tcp import TcpEngine

        if not TcpEngine.probe():
            pytest.skip("pyzmq not installed")
        eng = TcpEngine()
        attach = lambda d, n: eng.attach(d, n, b"credential")  # noqa: E731
        dereg = None
    elif engine == "rdma":
        from memsem.engines.rdma import RdmaEngine

        stub = _stub("rdma", ep="e")
        attach = lambda d, n: RdmaEngine.attach(stub, d, n)  # noqa: E731
        dereg = lambda d: RdmaEngine.deregister(stub, d)  # noqa: E731
    else:
        from memsem.engines.mte import MteEngine

        stub = _stub("mte", team=types.SimpleNamespace(team_id="t", my_pe=0, n_pes=2, heap_bytes=1 << 20),
                     _lock=__import__("threading").Lock(), _regs={})
        attach = lambda d, n: MteEngine.attach(stub, d, n)  # noqa: E731
        dereg = lambda d: MteEngine.deregister(stub, d)  # noqa: E731
    with pytest.raises(ValueError, match=rf"{engine} descriptor has no field '\w+'"):
        attach(desc, 64)
    if dereg is not None and engine in ("rdma", "mte"):
        with pytest.raises(ValueError, match=rf"{engine} descriptor has no field '\w+'"):
            dereg(desc)
    wrong_type = Descriptor(engine, {k: [v] for k, v in desc.fields.items()} | {
        "kind": ["shm"], "pid": "1", "endpoint": 5, "nbytes": "64", "team": 1, "ep": 2})
    with pytest.raises(ValueError, match=rf"{engine} descriptor (field '\w+' must be|has no field)"):
        attach(wrong_type, 64)


def test_descriptor_field_accessor():
    d = Descriptor("host", {"kind": "shm", "n": 3, "flag": True, "none": None})
    assert d.field("kind", str) == "shm" and d.field("n", int) == 3 and d.field("flag", bool) is True
    assert d.field("missing", int, 7) == 7 and d.field("none", int, 0) == 0
    with pytest.raises(ValueError, match="host descriptor field 'flag' must be int, got bool"):
        d.field("flag", int)
    with pytest.raises(ValueError, match=r"host descriptor has no field 'missing' \(fields: flag, kind, n, none\)"):
        d.field("missing", int)
    with pytest.raises(ValueError, match="descriptor has no field 'fields'"):
        Descriptor.from_json({"engine": "host"})


def test_engines_read_descriptors_only_through_the_typed_accessor():
    """The class of the bare ``KeyError: 'kind'``: no engine subscripts or .get()s a
    descriptor's fields (writes by the owner's own engine are fine)."""
    import ast
    import pathlib

    bad = []
    for path in (pathlib.Path(memsem.__file__).parent / "engines").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load) \
                    and isinstance(node.value, ast.Attribute) and node.value.attr == "fields":
                bad.append(f"{path.name}:{node.lineno}")
            if isinstance(node, ast.Attribute) and node.attr == "get" and isinstance(node.value, ast.Attribute) \
                    and node.value.attr == "fields":
                bad.append(f"{path.name}:{node.lineno}")
    assert not bad, bad


# -- numeric arguments: one door -----------------------------------------------------------------
BAD_TIMEOUTS = [(math.nan, ValueError), (math.inf, ValueError), (-1.0, ValueError), (1e12, ValueError),
                (True, TypeError), ("1", TypeError), (None if False else [1], TypeError)]


@pytest.fixture
def unmarked(rt):
    fs = rt.publish_fields({"x": ((8, 2), np.float32), "y": ((4,), np.int64)}, tile_rows=2, name="u")
    ref = rt.publish(np.zeros(64, np.uint8), tiles=4)
    return fs, ref


def _timeout_calls(rt, fs, ref):
    x = fs["x"]
    return {
        "FieldSet.tile_events": lambda t: fs.tile_events(timeout=t),
        "FieldSet.as_ready": lambda t: fs.as_ready(timeout=t),
        "FieldSet.wait": lambda t: fs.wait(timeout=t),
        "FieldSet.wait(field)": lambda t: fs.wait("x", timeout=t),
        "FieldSet.wait(rows)": lambda t: fs.wait("x", rows=(0, 4), timeout=t),
        "FieldRef.wait_tiles": lambda t: x.wait_tiles(timeout=t),
        "FieldRef.wait_rows": lambda t: x.wait_rows(0, 4, timeout=t),
        "FieldRef.get_rows": lambda t: x.get_rows(0, 4, timeout=t),
        "FieldRef.get_rows(wait=False)": lambda t: x.get_rows(0, 4, wait=False, timeout=t),
        "FieldRef.pipeline": lambda t: x.pipeline(timeout=t),
        "Runtime.pipeline": lambda t: rt.pipeline(ref, timeout=t),
        "TensorRef.wait_tile": lambda t: ref.wait_tile(0, timeout=t),
    }


@pytest.mark.parametrize("value, exc", BAD_TIMEOUTS, ids=lambda v: repr(v))
def test_every_timeout_goes_through_one_door(rt, unmarked, value, exc):
    """NaN, inf, negative, absurd, bool and non-numbers are refused at the call, before any wait
    (an unmarked window would otherwise block forever on NaN/inf)."""
    fs, ref = unmarked
    for name, call in _timeout_calls(rt, fs, ref).items():
        # refused, not waited: the wait that would follow is infinite or 1e12 s, so a call that
        # waited never returns (pytest-timeout ends the test): no wall-clock bound is asserted
        with pytest.raises(exc, match="timeout"):
            call(value)


def test_field_timeouts_report_the_timeout_given(rt, unmarked):
    fs, _ = unmarked
    x = fs["x"]
    x.put_rows(0, np.ones((2, 2), np.float32))
    for call in (lambda: x.wait_rows(0, 8, timeout=0.2), lambda: x.wait_tiles(timeout=0.2),
                 lambda: x.get_rows(0, 8, timeout=0.2), lambda: fs.wait(timeout=0.2),
                 lambda: fs.wait("x", rows=(2, 8), timeout=0.2)):
        with pytest.raises(MemsemTimeoutError, match=r"after 0\.2 s") as ei:
            call()
        assert ei.value.timeout == 0.2
        assert "field 'x'" in str(ei.value) and "tile 1" in str(ei.value)
    with pytest.raises(MemsemTimeoutError, match=r"not ready after 0\.2 s") as ei:
        list(fs.tile_events(timeout=0.2))
    assert ei.value.timeout == 0.2


@pytest.mark.parametrize("tile_rows, exc", [(0, ValueError), (-2, ValueError), (True, TypeError), (1.5, TypeError),
                                            ("2", TypeError), ({"x": 0}, ValueError), (1 << 40, ValueError)])
def test_publish_fields_tile_rows(rt, tile_rows, exc):
    with pytest.raises(exc, match="tile_rows"):
        rt.publish_fields({"x": ((8, 2), np.float32)}, tile_rows=tile_rows, name="tr")
    assert rt.directory.windows() == []  # nothing was left published


def test_sizes_counts_and_indices(rt, unmarked):
    fs, ref = unmarked
    cases = [
        (lambda: rt.pipeline(ref, tile_bytes=0), ValueError, "tile_bytes"),
        (lambda: rt.pipeline(ref, tile_bytes=True), TypeError, "tile_bytes"),
        (lambda: rt.pipeline(ref, tile_bytes=16.0), TypeError, "tile_bytes"),
        (lambda: rt.pipeline(ref, depth=0), ValueError, "depth"),
        (lambda: rt.pipeline(ref, depth=True), TypeError, "depth"),
        (lambda: rt.pipeline(ref, depth=2.0), TypeError, "depth"),
        (lambda: rt.pipeline(ref, wait_ready=1), TypeError, "wait_ready"),
        (lambda: fs["x"].pipeline(tiles_per_step=0), ValueError, "tiles_per_step"),
        (lambda: fs["x"].pipeline(tiles_per_step=True), TypeError, "tiles_per_step"),
        (lambda: ref.bytes(-1, 4), ValueError, "offset"),
        (lambda: ref.bytes(0, -4), ValueError, "nbytes"),
        (lambda: ref.bytes(True, 4), TypeError, "offset"),
        (lambda: ref.bytes(0, 4.0), TypeError, "nbytes"),
        (lambda: ref.bytes(60, 8), ValueError, "lies outside"),
        (lambda: ref.tile(True, 16), TypeError, "index"),
        (lambda: ref.tile(4, 16), ValueError, "index"),
        (lambda: ref.tile(0, 0), ValueError, "tile_bytes"),
        (lambda: ref.num_tiles(False), TypeError, "tile_bytes"),
        (lambda: ref.put_tile(True, np.zeros(16, np.uint8)), TypeError, "index"),
        (lambda: ref.put_tile(4, np.zeros(16, np.uint8)), ValueError, "index"),
        (lambda: ref.wait_tile(0, timeout=True), TypeError, "timeout"),
        (lambda: fs["x"].wait_tiles(-1, 2, timeout=1), ValueError, "start"),
        (lambda: fs["x"].wait_tiles(0, 9, timeout=1), ValueError, "stop"),
        (lambda: fs["x"].wait_tiles(3, 2, timeout=1), ValueError, "start > stop"),
        (lambda: fs["x"].get_rows(True, 2), TypeError, "rows"),
        (lambda: fs["x"].put_rows(0, np.ones((2, 2), np.float32), mark=1), TypeError, "mark"),
        (lambda: fs["x"].get_rows(0, 2, wait=1), TypeError, "wait"),
        (lambda: list(fs.tile_events("x", timeout=1)), TypeError, "fields"),
    ]
    for i, (call, exc, field) in enumerate(cases):
        with pytest.raises(exc, match=field):
            call()
            pytest.fail(f"case {i} ({field}) did not raise")


def test_huge_tile_bytes_and_depth_cost_nothing(rt):
    """Staging is bounded by the ref: one slot per tile, no slot larger than the ref."""
    ref = rt.publish(np.arange(32, dtype=np.uint8))
    with memsem.Runtime(timeout=5.0) as consumer:
        cref = consumer.ref(ref.to_bytes())
        with consumer.pipeline(cref, tile_bytes=1 << 50, depth=1 << 40, zero_copy=False) as p:
            tiles = [t.array.copy() for t in p]
        assert len(tiles) == 1 and (tiles[0] == np.arange(32)).all()
        with consumer.pipeline(cref, tile_bytes=8, depth=1 << 30, zero_copy=False) as p:
            assert b"".join(t.array.tobytes() for t in p) == bytes(range(32))


# -- alloc ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("shape", [0, (0,), (0, 4), (3, 0), (2, 0, 5)])
@pytest.mark.parametrize("dtype", [np.float32, "bfloat16", np.bool_])
def test_alloc_of_zero_elements_is_an_empty_array(rt, shape, dtype):
    a = rt.alloc(shape, dtype)
    assert a.size == 0 and a.shape == ((shape,) if isinstance(shape, int) else shape)
    assert a.dtype == memsem._dtypes.numpy_dtype(memsem._dtypes.code_of(dtype))
    ref = rt.publish(a)
    assert ref.nbytes == 0 and ref.get().shape == a.shape
    ref.put(np.zeros(a.shape, a.dtype))
    with memsem.Runtime(timeout=5.0) as consumer:
        assert consumer.ref(ref.to_bytes()).get().shape == a.shape


def test_publish_fields_with_zero_rows(rt):
    fs = rt.publish_fields({"x": ((0, 3), np.float32), "y": np.zeros((4, 2))}, name="z")
    assert fs["x"].rows == 0 and fs["x"].get_rows(0, 0, wait=False).shape == (0, 3)
    fs.wait("x", timeout=1.0)  # no rows: nothing to wait for
    assert [r.name for r in fs.as_ready(["x"], timeout=1.0)] == ["x"]
    assert list(fs.tile_events(["x"], timeout=1.0)) == []


@pytest.mark.parametrize("shape, dtype, exc, field", [
    (-1, np.float32, ValueError, "shape"),
    ((2, -1), np.float32, ValueError, r"shape\[1\]"),
    ((2.0,), np.float32, TypeError, r"shape\[0\]"),
    (True, np.float32, TypeError, "shape"),
    ("3", np.float32, TypeError, "shape"),
    ((1 << 40, 1 << 40), np.float32, ValueError, "shape"),
    ((1,) * 65, np.float32, ValueError, "dimensions"),
    (4, object, TypeError, "dtype=object"),
    (4, [("a", "i4")], TypeError, "dtype=.*structured"),
    (4, "U3", TypeError, "dtype=<U3"),
    (4, "M8[s]", TypeError, "dtype=.*datetime"),
    (4, "nope", TypeError, "dtype"),
])
def test_alloc_names_shape_and_dtype(rt, shape, dtype, exc, field):
    with pytest.raises(exc, match=field):
        rt.alloc(shape, dtype)
    with pytest.raises(exc, match=field):
        rt.publish_fields({"f": (shape, dtype)}, name="a")


# -- state-dict layouts read from a window -------------------------------------------------------
@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_state_dict_layout_parse_refuses_mutations_with_valueerror(data):
    from memsem.sync._state_dict import _HEAD, StateDictLayout

    code = memsem._dtypes.code_of
    lay = StateDictLayout.build([("a", code("float32"), (3, 4), 48), ("b", code("int64"), (), 8),
                                 ("c", code("bfloat16"), (0,), 0)], align=64, bucket_bytes=64,
                                framework="numpy")
    head = bytearray(lay.header())
    n = data.draw(st.integers(1, 8))
    for _ in range(n):
        i = data.draw(st.integers(0, len(head) - 1))
        head[i] = data.draw(st.integers(0, 255))
    magic, header_bytes, json_bytes = _HEAD.unpack_from(bytes(head))
    body = bytes(head[_HEAD.size:_HEAD.size + min(json_bytes, len(head))])
    window = lay.header_bytes + lay.data_bytes
    try:
        got = StateDictLayout.parse(bytes(head[:_HEAD.size]), body, window)
    except ValueError:
        return
    # whatever parses stays inside the window and is self-consistent
    for e in got.entries:
        assert e.offset + e.nbytes <= got.data_bytes and got.header_bytes + got.data_bytes <= window
