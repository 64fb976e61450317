"""Shared by the feature-composition tests (`tests/test_compose.py`, `tests/test_soak.py`,
`tests/_compose_worker.py`): a feature set as an `EngineConfig`, multi-turn request mixes,
and serving a mix while checking every request against the synchronous, one-shot,
all-resident engine.

A feature set (`Features`) picks: asynchronous scheduling, prefix caching, a prefill chunk
size, k speculative tokens and where the drafts come from (the model's MTP module, or the
reference's tokens right with probability 0.6: `tests.test_engine_stateful.ReferenceDraft`),
the KV row format, the residency (HiSparse under device-pool pressure, HiSparse with room,
all-resident, naive offload) and a mesh shape (None: the single-device `Engine`).

A mix (`Mix`) is a few conversations of one to three turns. Turn t + 1's prompt is turn t's
prompt, the tokens the engine generated for it and new user tokens, so prefix caching has
something to hit; conversations may share a system prefix. Each turn's requests are added
together and the engine runs until they finish; a request's expected output is the
reference engine's for the same prompt, length, temperature, stop tokens and sampling seed
(sampling keys are per request, so sampled tokens compare as well as greedy ones).

The model is the synthetic `tiny` (float32 compute and KV rows), or `tiny576` for the
"fp8_ds_mla" rows, both with an MTP module; the reference uses the same model and KV row
format (and, for fp8 rows prefilled in chunks, the same chunks: `reference_chunk`).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import numpy as np
from hypothesis import strategies as st

VOCAB = 512
BLOCK = 4
MAX_LEN = 64
SEATS = 4
TOP_K = 16  # the models' top_k


def pressure_blocks(spec_k: int) -> int:
    """Device blocks per layer under pressure: 4 seats of up to 16 pages would need 64 plus
    their hot regions of (1 + k) top_k rows; this many make requests wait, spill and read
    through hot regions, while the longest request fits alone."""
    return 26 + 4 * (1 + spec_k) * TOP_K // BLOCK


@dataclasses.dataclass(frozen=True)
class Features:
    async_scheduling: bool = False
    prefix_caching: bool = False
    chunk_size: int | None = None
    spec_k: int = 0
    draft: str = "mtp"  # "mtp" | "reference"
    kv_format: str = "bf16"
    residency: str = "pressure"  # "pressure" | "roomy" | "all" | "naive"
    mesh: str | None = None  # None | "2x1" | "2x2"

    def label(self) -> str:
        parts = [self.residency, self.kv_format]
        if self.async_scheduling:
            parts.append("async")
        if self.prefix_caching:
            parts.append("prefix")
        if self.chunk_size:
            parts.append(f"chunk{self.chunk_size}")
        if self.spec_k:
            parts.append(f"mtp{self.spec_k}:{self.draft}")
        if self.mesh:
            parts.append(f"mesh{self.mesh}")
        return "+".join(parts)


def features(*, mesh: bool = False) -> st.SearchStrategy[Features]:
    """Random feature sets that the engine accepts; with `mesh`, a mesh shape too (the caller
    runs under 4 virtual devices). Left out: prefix caching with naive offload (refused: that
    ablation reads every row from the host and keeps nothing on the device to reuse)."""
    return st.builds(
        Features,
        async_scheduling=st.booleans(),
        prefix_caching=st.booleans(),
        chunk_size=st.sampled_from([None, 5, 8, 16]),
        spec_k=st.sampled_from([0, 1, 2]),
        draft=st.sampled_from(["mtp", "reference"]),
        kv_format=st.sampled_from(["bf16", "fp8_ds_mla"]),
        residency=st.sampled_from(["pressure", "pressure", "roomy", "all", "naive"]),
        mesh=st.sampled_from(["2x1", "2x2"]) if mesh else st.none()).filter(accepted)


def accepted(f: Features) -> bool:
    """Whether the engine takes `f` (`features`' docstring says what it leaves out)."""
    return not (f.residency == "naive" and f.prefix_caching)


@dataclasses.dataclass(frozen=True)
class Turn:
    user_tokens: int
    max_new_tokens: int
    temperature: float
    stop: bool  # stop on the reference's 3rd token (a stop learned mid-run)


@dataclasses.dataclass(frozen=True)
class Mix:
    system_prefix: int  # tokens shared by every conversation's first prompt
    first_prompts: tuple[int, ...]  # per conversation, tokens after the shared prefix
    turns: tuple[tuple[Turn, ...], ...]  # per conversation
    seed: int


def mixes(max_conversations: int = 4) -> st.SearchStrategy[Mix]:
    turn = st.builds(Turn, user_tokens=st.integers(1, 9), max_new_tokens=st.integers(1, 9),
                     temperature=st.sampled_from([0.0, 0.0, 0.8]), stop=st.booleans())

    @st.composite
    def build(draw):
        n = draw(st.integers(1, max_conversations))
        return Mix(system_prefix=draw(st.sampled_from([0, 0, 9, 16])),
                   first_prompts=tuple(draw(st.integers(1, 20)) for _ in range(n)),
                   turns=tuple(tuple(draw(st.lists(turn, min_size=1, max_size=3)))
                               for _ in range(n)),
                   seed=draw(st.integers(0, 2 ** 16)))

    return build()


@functools.cache
def model(kv_format: str) -> Any:
    """The synthetic model of the KV row format (with an MTP module), built once: `tiny` with
    float32 rows for "bf16" (rows in the model's KV dtype), `tiny576` for "fp8_ds_mla"."""
    from hisparse_jax import models

    if kv_format == "fp8_ds_mla":
        return models.init_model(models.get_config("tiny576", mtp_layers=1), seed=0)
    return models.init_model(models.get_config("tiny", mtp_layers=1, kv_dtype="float32"),
                             seed=0)


def reference_chunk(f: Features) -> int | None:
    """The reference's prefill chunk: one shot, except that fp8 rows prefilled in chunks are
    compared with a reference that prefills in the same chunks. A chunk's values equal the
    one-shot prefill's up to float32 rounding (XLA sums by shape: `docs/semantics.md`,
    chunked prefill): float32 rows keep that in their last bits (the greedy tokens equal the
    one-shot prefill's, `tests/test_engine_chunked.py`), but it can move an fp8 row's
    quantized value by a whole e4m3 step."""
    return f.chunk_size if f.kv_format == "fp8_ds_mla" else None


def sizes(f: Features, **over: int) -> Any:
    from hisparse_jax.engine import Sizes

    blocks = pressure_blocks(f.spec_k) if f.residency == "pressure" else None
    hot = None if f.residency == "all" else (1 + f.spec_k) * TOP_K
    kw = dict(max_seats=SEATS, max_model_len=MAX_LEN, block_size=BLOCK, num_gpu_blocks=blocks,
              hot_size=hot)
    kw.update(over)
    return Sizes(**kw)


def engine_config(f: Features, reference: Any = None, **size_over: int) -> Any:
    """The `EngineConfig` of feature set `f` (`reference`: the `AllResidentReference` the
    "reference" draft source reads)."""
    from hisparse_jax.cache import AllResident, HiSparse, NaiveOffload
    from hisparse_jax.draft_sources import MTPDraft
    from hisparse_jax.engine import EngineConfig, PrefillPolicy, Speculative

    residency = {"pressure": HiSparse(), "roomy": HiSparse(), "all": AllResident(),
                 "naive": NaiveOffload()}[f.residency]
    speculative = None
    if f.spec_k:
        if f.draft == "reference":
            from tests.test_engine_stateful import ReferenceDraft

            draft = ReferenceDraft(reference)
        else:
            draft = MTPDraft()
        speculative = Speculative(num_tokens=f.spec_k, draft=draft)
    return EngineConfig(
        sizes=sizes(f, **size_over),
        prefill=PrefillPolicy(chunk_size=f.chunk_size, bucket=16,
                              prefix_caching=f.prefix_caching),
        residency=residency, speculative=speculative, kv_format=f.kv_format,
        async_scheduling=f.async_scheduling, compilation_cache=True, seed=0)


def reference_rows(f: Features) -> int:
    """Decode rows per device of the engine of `f`: its seats per data shard times the 1 + k
    rows each verifies. The reference decodes as many (XLA's CPU matmuls of another row
    count may round differently, and a near-tie of the random model then flips a token)."""
    shards = int(f.mesh.split("x")[0]) if f.mesh else 1
    return SEATS // shards * (1 + f.spec_k)


@functools.cache
def reference(kv_format: str, rows: int = SEATS, chunk: int | None = None) -> Any:
    """The synchronous, one-shot, all-resident engine's outputs (`AllResidentReference`)
    with `rows` decode rows, one per KV row format and row count, shared by every example."""
    from hisparse_jax.cache import AllResident
    from hisparse_jax.engine import Engine, EngineConfig, PrefillPolicy
    from tests.engine_reference import AllResidentReference

    ref = AllResidentReference.__new__(AllResidentReference)
    ref.engine = Engine(model(kv_format), EngineConfig(
        sizes=sizes(Features(residency="all"), max_seats=rows),
        prefill=PrefillPolicy(bucket=16, chunk_size=chunk),
        residency=AllResident(), kv_format=kv_format, seed=0))
    ref._cache = {}
    return ref


def build_engine(f: Features) -> Any:
    """The engine of `f`: `Engine`, or `MeshEngine` over the first devices (4 virtual CPU
    devices: the caller sets them)."""
    from hisparse_jax.engine import Engine

    ref = reference(f.kv_format, reference_rows(f), reference_chunk(f))
    config = engine_config(f, ref)
    if f.mesh is None:
        return Engine(model(f.kv_format), config)
    import jax

    from hisparse_jax.engine.mesh import MeshEngine, make_mesh

    data, tp = (int(x) for x in f.mesh.split("x"))
    mesh = make_mesh((data, tp), jax.devices()[:data * tp])
    return MeshEngine(model(f.kv_format), config, mesh=mesh)


def _tokens(rng: np.random.Generator, n: int) -> list[int]:
    return rng.integers(2, VOCAB, n).tolist()


def serve_mix(engine: Any, mix: Mix, f: Features) -> list[str]:
    """Serves `mix` turn by turn on `engine`; returns the mismatches against the reference
    (empty: every request exact). A turn that would pass `MAX_LEN` is cut short."""
    ref = reference(f.kv_format, reference_rows(f), reference_chunk(f))
    rng = np.random.default_rng(mix.seed)
    system = _tokens(rng, mix.system_prefix)
    convs = [system + _tokens(rng, n) for n in mix.first_prompts]
    problems: list[str] = []
    for t in range(max(len(turns) for turns in mix.turns)):
        added = {}
        for i, turns in enumerate(mix.turns):
            if t >= len(turns):
                continue
            turn = turns[t]
            prompt = convs[i] + (_tokens(rng, turn.user_tokens) if t else [])
            room = MAX_LEN - len(prompt)
            if room < 1:
                continue
            new = min(turn.max_new_tokens, room)
            seed = mix.seed * 97 + i * 7 + t
            stop: tuple[int, ...] = ()
            if turn.stop:  # a stop token the reference samples third
                probe = _probe(ref, prompt, new, turn.temperature, seed)
                stop = (probe[2],) if len(probe) > 2 else ()
            rid = engine.add_request(prompt, max_new_tokens=new, temperature=turn.temperature,
                                     stop_token_ids=stop, seed=seed)
            added[i] = (rid, prompt)
        if not added:
            break
        out = engine.run()
        for i, (rid, prompt) in added.items():
            got = out[rid]
            want = ref(got)
            have = (got.finish_reason, list(got.generated))
            if have != want:
                problems.append(f"{f.label()}: conversation {i} turn {t} (prompt "
                                f"{len(prompt)} tokens): got {have}, want {want}")
            convs[i] = prompt + list(got.generated)
    return problems


def _probe(ref: Any, prompt: list[int], new: int, temperature: float, seed: int) -> list[int]:
    """The reference's tokens for the request without stop tokens."""
    probe = _Probe(tuple(prompt), new, temperature, (), seed)
    return ref(probe)[1]


@dataclasses.dataclass(frozen=True)
class _Probe:
    prompt: tuple[int, ...]
    max_new_tokens: int
    temperature: float
    stop_token_ids: tuple[int, ...]
    sampling_seed: int


# Every feature at once: each test also runs these examples (hypothesis' @example).
EVERYTHING_MIX = Mix(system_prefix=9, first_prompts=(12, 5, 20),
                     turns=((Turn(3, 6, 0.0, False), Turn(4, 5, 0.8, True)),
                            (Turn(2, 7, 0.0, True),),
                            (Turn(5, 4, 0.8, False), Turn(2, 3, 0.0, False))), seed=3)


def everything(mesh: str | None = None) -> list[Features]:
    return [Features(async_scheduling=True, prefix_caching=True, chunk_size=5, spec_k=2,
                     draft=draft, kv_format=fmt, residency="pressure", mesh=mesh)
            for draft, fmt in (("mtp", "bf16"), ("reference", "fp8_ds_mla"))]
