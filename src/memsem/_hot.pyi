# Type stub of the CPython extension built from native/memsem_hot.c (the hot path's entry).
from typing import Any

RC_BUFFER: int
GIL_BYTES: int

def copy(plan: int, put: int | bool, offset: int, buf: Any, nbytes: int, code: int,
         version: int = 0, lease_slot: int = 0, lease_id: int = 0) -> int: ...

def copy_buf(plan: int, put: int | bool, offset: int, nbytes: int, code: int, buf: Any) -> int: ...

RC_WIRE_PENDING: int
RC_WIRE_LOST: int
RC_WIRE_SENDING: int

def wire(bracket: int, plan: int, fd: int, put: int | bool, offset: int, buf: Any, nbytes: int, code: int,
         head: bytes, rid: int, rbuf: bytearray, slice_ms: int) -> int: ...

def reply_header(buf: Any, offset: int) -> tuple[int, int, int, int, int, int]: ...
