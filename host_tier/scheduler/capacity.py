"""The coordinator's capacity rules, as functions of sizes and counts (standard library only).

No state: every function reads the sizes and counts it is given and returns an answer, the text
of an error (None when the rule holds), or raises ValueError for arguments out of range. The
caller decides what a broken rule becomes (`ValueError` at construction, `CapacityError` at
admission, a `Wait` reason while capacity is only short right now).

  - `device_pool_error`: the smallest device pool the coordinator accepts (a lone request of
    `max_model_len` tokens must reach its end);
  - `lone_request_error`: whether a lone request of a given prompt and length is served to
    completion (`Coordinator.capacity_error`; the rule and its proof: `docs/semantics.md`,
    the lone-request rule), with `hot_ask_tokens`, when such a request asks for its hot region;
  - `prompt_error`, `first_chunk_error`, `chunk_error`: a prompt or a chunk that can never fit;
  - `host_wait_reason`, `device_wait_reason`: why a `Wait` waits, and what releases capacity.
"""

from __future__ import annotations

from host_tier.scheduler.records import ACTIVE_TAIL_PAGES
from host_tier.sizes import cdiv, check_int

_OWNER = "Coordinator.capacity_error"


def device_pool_error(*, block_size: int, num_gpu_blocks: int, num_host_blocks: int,
                      hot_blocks: int, max_model_len: int) -> str | None:
    """Why a device pool of `num_gpu_blocks` ids (null block included) is too small, or None.

    A lone request of `max_model_len` tokens needs
    `hot_blocks + 1 + max(ACTIVE_TAIL_PAGES, max_pages - num_host_blocks)` usable blocks once
    it decodes: a hot region, the pages it cannot unpin (its pinned tail, or sealed pages the
    host pool has no block for) and one new page. Sizes are positive ints (checked by the
    caller).
    """
    max_pages = cdiv(max_model_len, block_size)
    unspillable = max_pages - num_host_blocks  # sealed pages past the host pool, at most
    min_device = hot_blocks + max(ACTIVE_TAIL_PAGES, unspillable) + 1
    if num_gpu_blocks - 1 >= min_device:
        return None
    pinned = (f"{ACTIVE_TAIL_PAGES} pinned tail pages" if unspillable <= ACTIVE_TAIL_PAGES
              else f"{unspillable} sealed pages the host pool's {num_host_blocks - 1} "
                   "usable blocks cannot take")
    return (f"Coordinator.num_gpu_blocks={num_gpu_blocks} leaves {num_gpu_blocks - 1} usable "
            f"blocks; one decoding request needs up to {min_device} (hot region of "
            f"{hot_blocks} + {pinned} + 1 new page) to reach max_model_len={max_model_len}")


def ask_at_tokens(*, num_usable: int, hot_blocks: int, block_size: int) -> int:
    """Computed tokens at which a request asks for a hot region whatever the free count: one
    more would leave no room, alone in the pool, for its pages, the pages of its next two
    one-token steps and a hot region (`cdiv(tokens + 2, B) + hot_blocks > num_usable`)."""
    return (num_usable - hot_blocks) * block_size - 1


def hot_ask_tokens(num_prompt_tokens: int, *, block_size: int, num_usable: int,
                   watermark: int, ask_at: int, offload_all: bool) -> int:
    """The tokens a lone request holds after the step that makes it ask for its hot region.

    Alone, its free blocks are `num_usable` less its pages: it asks once they drop below
    `watermark` or it holds `ask_at` tokens (`ResidencyPolicy.update`), at admission at the
    earliest; with `offload_all` it asks at once.
    """
    P, B = num_prompt_tokens, block_size
    if offload_all:
        return P
    under_watermark = num_usable - watermark + 1  # pages that leave free < watermark
    return min(max(P, ask_at), max(P, (under_watermark - 1) * B + 1))


def lone_request_error(num_prompt_tokens: int, max_total_tokens: int, *,
                       num_lookahead_tokens: int, block_size: int, hot_blocks: int,
                       num_usable: int, num_host_usable: int, max_model_len: int,
                       watermark: int, ask_at: int, offload_all: bool) -> str | None:
    """Why a lone request is never served to completion, or None (`Coordinator.capacity_error`
    states the question; `num_usable` / `num_host_usable` are the pools' usable blocks,
    `watermark`, `ask_at` and `offload_all` the residency policy's).

    Raises:
      ValueError: the counts are not ints with 1 <= num_prompt_tokens <= max_total_tokens, or
        num_lookahead_tokens is not an int in [0, block_size).
    """
    P = check_int(_OWNER, "num_prompt_tokens", num_prompt_tokens)
    T = check_int(_OWNER, "max_total_tokens", max_total_tokens)
    if T < P:
        raise ValueError(
            f"{_OWNER}: max_total_tokens={T} is less than "
            f"num_prompt_tokens={P} (it counts the prompt too)")
    la = check_int(_OWNER, "num_lookahead_tokens", num_lookahead_tokens, minimum=0)
    if la >= block_size:
        raise ValueError(f"{_OWNER}: num_lookahead_tokens must be < "
                         f"block_size={block_size}, got {la}")
    B, H, usable = block_size, hot_blocks, num_usable
    if T > max_model_len:
        return (f"max_model_len: the request holds up to {T} tokens ({P} in the prompt), "
                f"more than max_model_len={max_model_len}")
    prompt_pages = cdiv(P, B)
    if prompt_pages > num_host_usable:
        return (f"host pool: the prompt needs {prompt_pages} host blocks, the host pool has "
                f"only {num_host_usable}")
    if prompt_pages > usable:
        return (f"device pool: the prompt needs {prompt_pages} device blocks at admission, "
                f"the device pool has only {usable}")
    ask = hot_ask_tokens(P, block_size=B, num_usable=usable, watermark=watermark,
                         ask_at=ask_at, offload_all=offload_all)
    if ask >= T:
        return None  # it ends before it asks: never more than its own pages (rule above)
    # The grant comes with the step that writes token `ask`: every page is still pinned
    # (and the step's lookahead rows may open one more).
    pages = cdiv(ask, B)
    opens = cdiv(min(ask + 1 + la, T), B) - pages
    need = pages + opens + H
    if need > usable:
        return (f"device pool: alone, the request asks for its hot region once it holds "
                f"{ask} tokens ({pages} pages, all pinned); the grant needs {need} device "
                f"blocks ({pages} pages + {opens} new + a hot region of {H}), the device "
                f"pool has only {usable}; shorten the prompt or raise num_gpu_blocks")
    # From then on, each new page q needs the hot region, the pages it cannot unpin (its
    # last ACTIVE_TAIL_PAGES, and sealed pages past the host pool, which stay dirty) and
    # itself; the need grows with q, so the last page decides.
    last = cdiv(T, B) - 1
    if last >= pages + opens:
        pinned = max(min(last, ACTIVE_TAIL_PAGES), last - num_host_usable)
        need = H + pinned + 1
        if need > usable:
            return (f"device pool: alone, the request needs {need} device blocks when it "
                    f"opens page {last} (a hot region of {H} + {pinned} pages it cannot "
                    f"unpin: its last {ACTIVE_TAIL_PAGES}, or sealed pages past the host "
                    f"pool's {num_host_usable} blocks + 1 new page), the device pool has only "
                    f"{usable}; raise num_gpu_blocks or num_host_blocks")
    return None


def prompt_error(num_tokens: int, *, block_size: int, max_model_len: int,
                 num_host_usable: int) -> str | None:
    """Why a prompt of `num_tokens` tokens can never be admitted (longer than max_model_len,
    or more pages than the host pool's usable blocks), or None."""
    if num_tokens > max_model_len:
        return (f"admit: prompt_token_ids has {num_tokens} tokens, more than "
                f"max_model_len={max_model_len}")
    prompt_pages = cdiv(num_tokens, block_size)
    if prompt_pages > num_host_usable:
        return (f"admit: the prompt needs {prompt_pages} host blocks, the host pool has only "
                f"{num_host_usable}; raise host_pool_gib")
    return None


def first_chunk_error(device_need: int, num_usable: int) -> str | None:
    """Why an admission needing `device_need` device blocks can never happen, or None."""
    if device_need <= num_usable:
        return None
    return (f"admit: the first chunk needs {device_need} device blocks, the device pool has "
            f"only {num_usable}; admit it with a smaller num_new_tokens")


def chunk_error(what: str, num_tokens: int, need: int, num_usable: int) -> str | None:
    """Why scheduling `num_tokens` tokens that need `need` device blocks can never happen
    (`what` names the call), or None."""
    if need <= num_usable:
        return None
    return (f"{what}: {num_tokens} tokens need {need} device blocks, the device pool has only "
            f"{num_usable}; schedule a smaller chunk")


def host_wait_reason(needed: int, available: int, what: str, *, num_in_flight: int,
                     num_detached: int) -> str:
    """Why `what` waits for `needed` host blocks (`available` now), and what releases them:
    transfers in flight and finished requests awaiting their last copies, or other requests."""
    text = (f"host pool full: {what} needs {needed} free host blocks, {available} are "
            "available")
    if num_in_flight or num_detached:
        return text + (f"; {num_in_flight} transfers in flight and {num_detached} "
                       "finished requests awaiting their last copies hold host blocks that "
                       "are released as the worker reports completions")
    return text + "; finish or preempt running requests to release host blocks"


def device_wait_reason(needed: int, num_free: int, what: str, *, num_unenqueued: int) -> str:
    """Why `what` waits for `needed` device blocks (`num_free` free now), and what frees them:
    spills not yet enqueued pin their pages, and clean pages unpin."""
    text = (f"device pool full: {what} needs {needed} free device blocks, "
            f"{num_free} are free")
    if num_unenqueued:
        return text + (f"; {num_unenqueued} pages are pinned until the worker enqueues their "
                       "spills")
    return text + "; pages unpin once their host copies complete, or preempt a request"
