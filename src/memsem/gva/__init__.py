"""GVA layer: address space, windows' control blocks, generation, lease and ready-word logic.

Pure data plus atomics; no transport.
"""
from memsem.gva import _inflight_slots as inflight_slots
from memsem.gva import _lease_slots as lease_slots
from memsem.gva import _ready_words as ready_words
from memsem.gva._address import (
    GVA_ALIGN,
    RANK_SHIFT,
    SliceAllocator,
    WindowInfo,
    key_digest,
    key_matches,
    make_gva,
    split_gva,
)
from memsem.gva._refspec import (
    Mint,
    RefSpec,
    credential_proof,
    credential_token,
    mint_mac,
    mint_valid,
    parse_token,
)
from memsem.gva._control_block import (
    PERM_READ,
    PERM_WRITE,
    ControlBlock,
    WindowState,
    control_block_bytes,
    new_generation,
)

__all__ = [
    "GVA_ALIGN", "RANK_SHIFT", "SliceAllocator", "WindowInfo", "key_digest", "key_matches",
    "make_gva", "split_gva", "PERM_READ", "PERM_WRITE", "ControlBlock", "WindowState",
    "control_block_bytes", "new_generation", "inflight_slots", "lease_slots", "ready_words", "RefSpec", "Mint",
    "mint_mac", "mint_valid", "credential_token", "credential_proof", "parse_token",
]
