"""A small serving engine: a transformers hybrid model whose whole cache lives in a hybridkv
:class:`~hybridkv.plan.MemoryPlan`, with block ids from :class:`~hybridkv.alloc.HybridAllocator`.

The engine schedules with :class:`hybridkv.sched.Scheduler`, the scheduler the simulator
runs (decode first, chunked prefill under a token budget, admission by ``max_num_seqs`` and
memory, preemption with recompute, each checkpoint policy's chunk ends), and is that scheduler's
model-running :class:`~hybridkv.sched.Executor`. One :meth:`Engine.step`:

1. the scheduler admits waiting requests (``add_request``) and gives every running request its
   next tokens (``allocate_slots``): the one token it sampled last, or the rest of its prompt in
   chunks that end where the checkpoint policy wants a state; when memory is full the newest
   request is preempted (``free``) and later re-added with its prompt plus what it generated so
   far, i.e. recomputed;
2. :meth:`Engine.execute`: an admitted request's prefix hit ``state_copies`` (checkpoint slot ->
   running slot) and ``kv_copies`` run first, and only the uncached tail is computed; without a
   hit the running slot is reset to a fresh state (it holds whatever its last owner, or the NaN
   poison, left). Then one batched ``[B, 1]`` forward for all requests that bring one token
   (decode) and one packed varlen ``[1, T]`` forward for every prefill chunk of the step,
   whatever their lengths (``batch_prefill=False``: one forward per chunk). Around each, the
   requests' recurrent states are gathered from their slots (``gather_states``) and handed to
   transformers' mixers (in a ``DynamicCache``, or the model's own cache or state argument, for
   the batch; per request, segment by segment, in the packed forward:
   :func:`.states.install_varlen`), and scattered back (``scatter_states``) after; attention
   goes through :mod:`.attn` (pages, block tables and, packed, ``cu_seqlens``); greedy
   sampling;
3. the commit: ``take_state_copies()`` run by :meth:`Engine.checkpoint` (running slot ->
   checkpoint slot), then the scheduler hands the sampled tokens to the allocator
   (``append_tokens``) and frees finished requests.

Where transformers keeps each kind of recurrent state, and how the plan's slot layouts (vLLM's)
convert to it, is :mod:`.states` (one :class:`~.states.StateFormat` per state kind); the engine
only gathers a batch's slots, hands them over and scatters them back.

Families (tests/test_e2e.py, tests/test_e2e_families.py), each matching transformers out of every
layout: Bamba, Qwen3-Next, Falcon-H1 (attention and Mamba-2 in one layer), GraniteMoeHybrid,
NemotronH, Zamba2 (its shared attention module is called with the decoder layer's index, which
:func:`.attn.track_layer_index` records), Qwen3.5, Jamba (Mamba-1), LFM2 and LFM3 (short conv;
LFM3's sliding windows through the kernels' window path), RecurrentGemma (RG-LRU state in the
model's modules; local attention through the kernels' sliding-window path), Kimi-Linear and Bailing
hybrid (KDA; MLA through :func:`.attn.mla_forward` and ``mla_decode_attention``, Bailing's with a
rotary rope part and an output gate), GLM-5-Next (KDA; a NoPE MLA with DeepSeek sparse attention:
:func:`.attn.dsa_forward` picks each query's tokens with the layer's indexer over its pages and
the MLA walks that list). Jamba's and RecurrentGemma's recurrent modules cannot
continue a multi-token forward from a state in transformers, so the engine steps them token by
token (:mod:`.states`). MiniMax (lightning attention) keeps its state in its own ``MiniMaxCache``,
which its forward insists on: the engine builds each forward's cache with
:func:`.states.cache_factory`. RWKV-4 and xLSTM (no attention) keep their states in what their
forwards take as ``state`` (five tensors) and ``cache`` (an ``xLSTMCache``)
(:func:`.states.cache_argument`); transformers' RWKV one-token forward is right for one sequence
only, so RWKV's decoders run as one packed forward of one-token segments. ZAYA keeps its
Compressed Convolutional Attention state (q / k conv window, delayed value half) in its
attention layers' cache beside the K / V; its attention after that is plain GQA over the pages.
Inkling keeps four short-conv states in its attention layers' cache, each run by its own module
(one :class:`_StateLayer` per module), and adds a relative-position bias to every attention
logit, computed in the paged kernels from the query tokens' relative states and the layer's
bank (:func:`.attn.relative_bias_forward`). Qwen4-Exp runs its indexed attention through
:func:`.attn.qsa_forward` (the QSA indexer's pick over the plan's indexer pages, then the gated
GQA over each query token's list in the decode kernel's sparse walk), and its Per-Layer
Embedding's conv window through the ``ple_conv`` format, whose n-gram context is rebuilt from
each request's tokens per forward (:func:`.states.derived_parts`).
A plan with a layer kind no :class:`~.states.StateFormat` wires is refused with a
:class:`~.states.Unservable` (a NotImplementedError) naming it and what is served
(:func:`.states.check_wired`). Learnable attention sinks (GraniteSWA's ``s_aux``) run in the
paged kernels.

Private transformers fields: only ``config._attn_implementation``, saved, set and restored by
:meth:`Engine._paged_attention` so that the same model still runs stock attention outside the
engine (``PreTrainedModel.set_attn_implementation`` is the public setter, but it validates
and dispatches over sub-configs and offers no public read of the current value to restore).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from itertools import accumulate
from typing import Any

import numpy as np
import torch

from ..alloc import AllocatorOptions, HybridAllocator
from ..alloc.options import AUTO
from ..plan import MemoryPlan
from ..replay import SERVING_ALPHA_STRIDE, AlphaTuner
from ..sched import Scheduler, SchedulerConfig, Seq, StepOutput
from ..traces import Request as TraceRequest
from . import attn
from .states import (
    FORMATS,
    Packed,
    StateFormat,
    cache_argument,
    cache_factory,
    check_wired,
    derived_history,
    derived_parts,
    has_own_state,
    install_stepwise,
    install_varlen,
)
from .states import packed as packed_states

__all__ = ["Engine", "Request", "engine_options", "hf_greedy"]


class Request(Seq):
    """A request as the engine tracks it: the scheduler's :class:`~hybridkv.sched.Seq` plus
    ``logits[i]``, the fp32 logits row that chose ``output[i]``."""

    __slots__ = ("logits",)

    def __init__(self, rid: Any, prompt: Sequence[int], max_new_tokens: int) -> None:
        super().__init__(rid, list(prompt), max_new_tokens)
        self.logits: list[torch.Tensor] = []

    @property
    def output(self) -> list[int]:
        return self.outputs


@dataclass
class _StateLayer:
    """One recurrent layer's state run by one module: its HF layer index, state group, the
    plan's slot views (``part -> [num_slots, ...]``), how they map to transformers and the
    mixer module. A layer whose parts are run by several modules (Inkling's four short convs,
    :meth:`.states.StateFormat.per_module`) is one of these per module, same index."""

    idx: int
    gid: int
    pools: dict[str, torch.Tensor]
    fmt: StateFormat
    module: torch.nn.Module


def _as_trace_request(r: Request, index: int) -> TraceRequest:
    """A finished request as the alpha tuner's replays resend it: its prompt and answer."""
    out = np.asarray(r.output, dtype=np.int64)
    return TraceRequest(index, 0.0, np.asarray(r.prompt, dtype=np.int32), len(out), out)


def engine_options(
    config: Any, options: AllocatorOptions | None = None, **overrides: Any
) -> AllocatorOptions:
    """The allocator options an :class:`Engine` of a model with transformers ``config`` runs
    with: ``options`` with ``overrides``, where

    - ``options`` defaults to :class:`~hybridkv.alloc.AllocatorOptions` with ``max_model_len``
      the model's ``max_position_embeddings`` (the options' default where a model has none,
      as RecurrentGemma);
    - ``prefill_checkpoint_alignment`` is ``None``: the engine's prefill writes a state only
      where a step ends, so it cannot export the mid-prefill checkpoints vLLM's Mamba-2 /
      FlashInfer GDN kernels do, and the scheduler splits the prefill at the checkpoint
      instead (as vLLM's does for such kernels). ``"auto"`` (the default) resolves to that;
      a number raises ``ValueError``;
    - ``kv_events`` is off by default: the engine publishes no KV events (its scheduler takes
      and drops them each step), so building them would only cost time. Options that ask for
      them raise ``ValueError``."""
    if options is None:
        limit = getattr(config, "max_position_embeddings", None)
        options = AllocatorOptions(kv_events=False)
        if limit is not None:
            options = options.replace(max_model_len=limit)
    options = options.replace(**overrides)
    if options.prefill_checkpoint_alignment not in (AUTO, None):
        raise ValueError(
            "the engine's prefill cannot export states from inside a chunk; leave "
            "prefill_checkpoint_alignment 'auto' or None (chunks then end where states are kept)"
        )
    if options.kv_events:
        raise ValueError(
            "the engine publishes no KV events (its scheduler drops them each step); pass "
            "kv_events=False, or drive a HybridAllocator yourself and read take_events()"
        )
    return options.replace(prefill_checkpoint_alignment=None)


class Engine:
    """Serve greedy generations of ``model`` out of ``plan``'s memory.

    ``poison``: fill the cache memory with NaN first, so any read of memory nothing wrote
    shows up in the logits. ``prefill_chunk``: the most prompt tokens one request computes per
    step (the scheduler's ``long_prefill_token_threshold``); ``max_num_batched_tokens``: the
    step's token budget. ``batch_prefill``: the step's prefill chunks run as one packed varlen
    forward (default), or one forward each (the reference the packed one is tested against).
    ``on_step``: called with every step's
    :class:`~hybridkv.sched.StepOutput` after it ran. ``options``: the allocator's
    (:class:`~hybridkv.alloc.AllocatorOptions`); keyword ``overrides`` replace some of them
    (``checkpoint_policy="last"``, ...). What the engine decides itself is
    :func:`engine_options`. Under Marconi's eviction with ``marconi_alpha="auto"`` (the
    default) the engine tunes alpha as the simulator does (``alpha_tuner``: Marconi's replays
    of the requests it finished, on allocators of its own, once their window is seen).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        plan: MemoryPlan,
        options: AllocatorOptions | None = None,
        *,
        max_num_seqs: int | None = None,
        prefill_chunk: int = 64,
        max_num_batched_tokens: int = 8192,
        batch_prefill: bool = True,
        poison: bool = True,
        on_step: Callable[[StepOutput], None] | None = None,
        **overrides: Any,
    ) -> None:
        check_wired(plan)  # Unservable, with the reason, for a refused family
        attn.register()
        self.model = model
        self.config = model.config
        self.plan = plan
        options = engine_options(self.config, options, **overrides)
        self.alloc = HybridAllocator(plan, options)
        self.alpha_tuner = (
            AlphaTuner(
                lambda: HybridAllocator(plan, options),
                stride=SERVING_ALPHA_STRIDE,
                flops=options.marconi_flops,
            )
            if options.tunes_marconi_alpha
            else None
        )
        self.scheduler = Scheduler(
            self.alloc,
            SchedulerConfig(
                max_num_seqs=max_num_seqs or plan.config.max_num_seqs,
                max_num_batched_tokens=max_num_batched_tokens,
                long_prefill_token_threshold=prefill_chunk,
            ),
        )
        self.on_step = on_step
        self.batch_prefill = batch_prefill
        # int8 -1 is 0xFF in every byte: NaN in fp32, fp16 and bf16
        self.buffers = plan.allocate("cpu", fill=-1 if poison else 0)
        self.ctx = attn.PagedContext(plan, self.buffers, [])
        self.state_layers: list[_StateLayer] = []
        for p in plan.state_placements:
            views = plan.state_views(self.buffers, p.layer)
            for fmt in FORMATS[p.kind].per_module():
                module = fmt.module_of(model, p.layer_index)
                if fmt.stepwise:
                    install_stepwise(module)
                install_varlen(module, fmt, p.layer_index)  # after install_stepwise: it wraps it
                self.state_layers.append(
                    _StateLayer(
                        idx=p.layer_index,
                        gid=p.group_id,
                        pools={n: views[n] for n in fmt.parts},
                        fmt=fmt,
                        module=module,
                    )
                )
        kinds = [p.kind for p in plan.state_placements]
        self.new_cache = cache_factory(self.config, kinds)
        # RWKV: `state`, xLSTM: `cache`; the rest transformers' cache keyword
        self.cache_argument = cache_argument(kinds, model.forward)
        # RWKV's one-token forward is wrong for a batch of more than one: its decoders run as
        # one packed forward of one-token segments instead (StateFormat.batched_decode)
        self.batched_decode = all(s.fmt.batched_decode for s in self.state_layers)
        attn.track_layer_index(model)
        attn.install_mla_layers(model, plan)
        attn.install_relative_bias_layers(model)
        attn.install_qsa_layers(model, plan)
        self.attn_layers = self.ctx.views  # layer index -> (k_cache, v_cache, group id)
        text = self.config.get_text_config()  # a multimodal model's (GLM-5-Next) text part
        types = set(getattr(text, "layer_types", None) or [])
        types |= set(getattr(text, "layers_block_type", None) or [])
        # a dict mask bypasses HF's mask construction: the paged kernels bound and mask
        # attention by position, and the recurrent layers see no padding
        # (Inkling's model reads "sliding_attention" for its "hybrid_sliding" layers)
        self.masks = dict.fromkeys(
            types | {"full_attention", "sliding_attention", "linear_attention"}
        )
        # a model without attention (RWKV, xLSTM) builds no mask (RWKV warns on one)
        self.mask_kwargs = {"attention_mask": self.masks} if plan.kv_placements else {}
        self.finished: dict[Any, Request] = {}
        self.num_steps = self.num_forwards = 0
        self.num_state_copies = self.num_checkpoints = self.num_kv_copies = 0
        self.max_decode_batch = 0

    # ---- public ----------------------------------------------------------------------------
    @property
    def waiting(self) -> deque[Seq]:
        return self.scheduler.waiting

    @property
    def running(self) -> list[Seq]:
        return self.scheduler.running

    @property
    def num_preemptions(self) -> int:
        return self.scheduler.num_preemptions

    def add_request(self, rid: Any, prompt: Sequence[int], max_new_tokens: int) -> Request:
        req = Request(rid, prompt, max_new_tokens)
        self.scheduler.add(req)
        return req

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def run(self, max_steps: int = 10_000) -> dict[Any, Request]:
        """Step until every request has finished."""
        for _ in range(max_steps):
            if not self.has_work():
                return self.finished
            self.step()
        raise RuntimeError(f"requests still running after {max_steps} steps")

    def generate(
        self, prompts: dict[Any, Sequence[int]], max_new_tokens: int
    ) -> dict[Any, list[int]]:
        """Serve ``prompts`` (with those already queued) to the end; their outputs."""
        for rid, p in prompts.items():
            self.add_request(rid, p, max_new_tokens)
        self.run()
        return {rid: self.finished[rid].output for rid in prompts}

    def step(self) -> None:
        """One scheduler step, run on the model."""
        out = self.scheduler.step(self)
        if not out.has_work:
            raise RuntimeError(self.scheduler.stuck_message())
        self.num_steps += 1
        for r in out.finished:
            self.finished[r.rid] = r
            if self.alpha_tuner is not None:
                self.alpha_tuner.observe(self.alloc, _as_trace_request(r, self.alpha_tuner.count))
        if self.on_step is not None:
            self.on_step(out)

    # ---- the executor ----------------------------------------------------------------------
    def execute(self, out: StepOutput) -> list[int]:
        """Run one scheduled step: restore admitted hits, forward, greedy-sample."""
        for r in out.admitted:
            hit = r.hits[-1]
            if hit.num_cached_tokens:
                self._run_state_copies(hit.state_copies, checkpoint=False)
                self._run_kv_copies(hit.kv_copies)
            else:
                self._fresh_states(r)
        self.max_decode_batch = max(self.max_decode_batch, len(out.decode))
        sampled: dict[int, int] = {}
        if out.decode:
            decode = [(r, r.num_tokens - 1, 1) for r in out.decode]
            sampled.update(self._forward(decode, packed=not self.batched_decode))
        if out.prefill and self.batch_prefill:
            sampled.update(self._forward(out.prefill, packed=True))
        elif out.prefill:
            for chunk in out.prefill:
                sampled.update(self._forward([chunk]))
        return [sampled[id(r)] for r in out.sampling]

    def checkpoint(self, copies: list[tuple[int, int, int]]) -> None:
        """The commit's state checkpoints (running slot -> checkpoint slot)."""
        self._run_state_copies(copies, checkpoint=True)

    # ---- forward ---------------------------------------------------------------------------
    def _forward(
        self, batch: list[tuple[Request, int, int]], *, packed: bool = False
    ) -> dict[int, int]:
        """One forward of ``batch`` (``(request, start, num_tokens)``) through the HF model: a
        ``[B, T]`` batch (equal token counts) or, ``packed``, one ``[1, sum of counts]``
        sequence (any counts); the token sampled by each request that reached the end of its
        known tokens (keyed by ``id(request)``)."""
        self.num_forwards += 1
        reqs = [r for r, _, _ in batch]
        start = torch.tensor([s for _, s, _ in batch], dtype=torch.int64)
        if packed:
            cu = torch.tensor([0, *accumulate(n for _, _, n in batch)], dtype=torch.int64)
            ids = torch.tensor([[x for r, s, n in batch for x in r.token_range(s, s + n)]])
            pos = torch.cat([torch.arange(s, s + n) for _, s, n in batch])[None]
            keep: int | torch.Tensor = cu[1:] - 1  # each request's last token
        else:
            t = batch[0][2]
            if any(n != t for _, _, n in batch):
                raise ValueError(f"a batched forward needs equal token counts, got {batch}")
            cu = None
            ids = torch.tensor([r.token_range(s, s + t) for r, s, _ in batch])
            pos = start[:, None] + torch.arange(t)
            keep = 1
        tables = self.alloc.block_tables([r.rid for r in reqs])
        self.ctx.begin_forward(tables, start, cu)
        cache = self.new_cache()
        slots, states = self._gather_states(reqs)
        for s in self.state_layers:  # parts made from the tokens, not slots (Qwen4-Exp's n-grams)
            if s.fmt.derived:
                width = derived_history(s.fmt, self.config)
                before = [r.token_range(max(0, s0 - width), s0) for r, s0, _ in batch]
                states[s.idx].update(derived_parts(s.fmt, self.config, before))
        if packed:
            recurrent = packed_states(Packed(cu.tolist(), cache, states, self.new_cache))
        else:
            for s in self.state_layers:
                s.fmt.load(cache, s.module, s.idx, states[s.idx])
            recurrent = nullcontext()
        with self._paged_attention(), recurrent, torch.no_grad():
            out = self.model(
                input_ids=ids,
                position_ids=pos,
                use_cache=True,
                logits_to_keep=keep,
                **{self.cache_argument: cache},
                **self.mask_kwargs,
            )
        if not packed:
            states = {}
            for s in self.state_layers:  # a layer's modules each store their own parts
                states.setdefault(s.idx, {}).update(s.fmt.store(cache, s.module, s.idx))
        self._scatter_states(slots, states)
        if packed:
            rows = out.logits[0]
            if rows.shape[0] != len(batch):  # xLSTM's forward takes no logits_to_keep
                rows = rows[keep]
        else:
            rows = out.logits[:, -1]
        logits = rows.float()  # [B, vocab]
        sampled = {}
        for b, (r, s, n) in enumerate(batch):
            if s + n == r.num_tokens:
                r.logits.append(logits[b].clone())
                sampled[id(r)] = int(logits[b].argmax())
        return sampled

    @contextmanager
    def _paged_attention(self) -> Iterator[None]:
        """Route the model's attention through :mod:`.attn` for one forward, so that the same
        model object still runs stock transformers outside the engine (the reference)."""
        configs = {id(m.config): m.config for m in self.model.modules() if hasattr(m, "config")}
        saved = {k: c._attn_implementation for k, c in configs.items()}
        attn.set_context(self.ctx)
        try:
            for c in configs.values():
                c._attn_implementation = attn.ATTN_NAME
            yield
        finally:
            for k, c in configs.items():
                c._attn_implementation = saved[k]
            attn.set_context(None)

    def _gather_states(
        self, reqs: list[Request]
    ) -> tuple[dict[int, torch.Tensor], dict[int, dict[str, torch.Tensor]]]:
        """The requests' slots per state group ``[B]`` and every state layer's states (layer
        index -> part -> ``[B, ...]``, the plan's layout), gathered from the slots."""
        from ..kernels import plan_gather_states

        slots: dict[int, torch.Tensor] = {}
        plans: dict[tuple, object] = {}  # one gather plan per group and state part
        states: dict[int, dict[str, torch.Tensor]] = {}
        for s in self.state_layers:
            if s.gid not in slots:
                ids = [self.alloc.state_slot(r.rid, s.gid) for r in reqs]
                slots[s.gid] = torch.tensor(ids, dtype=torch.int64)
            states.setdefault(s.idx, {})  # a layer run by several modules: one dict
            for n, pool in s.pools.items():
                key = (s.gid, n, tuple(pool.shape[1:]), pool.dtype)
                if key not in plans:
                    plans[key] = plan_gather_states(
                        slots[s.gid], dtype=pool.dtype, row_shape=tuple(pool.shape[1:])
                    )
                states[s.idx][n] = plans[key].run(pool)
        return slots, states

    def _scatter_states(
        self, slots: dict[int, torch.Tensor], states: dict[int, dict[str, torch.Tensor]]
    ) -> None:
        """Scatter the updated states back into their slots."""
        from ..kernels import plan_scatter_states

        plans: dict[tuple, object] = {}  # one scatter plan per group and state part
        for s in self.state_layers:
            for n, pool in s.pools.items():
                t = states[s.idx][n]
                key = (s.gid, n, tuple(pool.shape[1:]), pool.dtype)
                if key not in plans:
                    plans[key] = plan_scatter_states(
                        slots[s.gid], dtype=pool.dtype, row_shape=tuple(pool.shape[1:])
                    )
                plans[key].run(pool, t)

    # ---- copies ----------------------------------------------------------------------------
    def _fresh_states(self, r: Request) -> None:
        """A request without a hit starts from transformers' initial state (zeros; RWKV's WKV
        maximum at -1e30: :meth:`.states.StateFormat.fresh`); its slot still holds its
        previous owner's state (or the NaN poison)."""
        from ..kernels import scatter_states

        for s in self.state_layers:
            ids = torch.tensor([self.alloc.state_slot(r.rid, s.gid)], dtype=torch.int64)
            for n, pool in s.pools.items():
                fresh = s.fmt.fresh(n, tuple(pool.shape[1:]), pool.dtype, s.module)
                scatter_states(pool, ids, fresh)

    def _run_state_copies(self, copies: list[tuple[int, int, int]], *, checkpoint: bool) -> None:
        """``(group, src slot, dst slot)`` for every state layer of the group."""
        from ..kernels import plan_copy_states

        if not copies:
            return
        if checkpoint:
            self.num_checkpoints += len(copies)
        else:
            self.num_state_copies += len(copies)
        by_group: dict[int, tuple[list[int], list[int]]] = {}
        for gid, src, dst in copies:
            by_group.setdefault(gid, ([], []))
            by_group[gid][0].append(src)
            by_group[gid][1].append(dst)
        plans: dict[tuple, object] = {}  # one copy plan per group and state part
        for s in self.state_layers:
            if s.gid not in by_group:
                continue
            for n, pool in s.pools.items():
                key = (s.gid, n, tuple(pool.shape[1:]), pool.dtype)
                if key not in plans:
                    src, dst = (torch.tensor(x, dtype=torch.int64) for x in by_group[s.gid])
                    plans[key] = plan_copy_states(
                        src, dst, dtype=pool.dtype, row_shape=tuple(pool.shape[1:])
                    )
                plans[key].run(pool)

    def _run_kv_copies(self, copies: list[tuple[int, int, int, int]]) -> None:
        """``(group, src block, dst block, num_tokens)``: the first tokens of a partly reused
        block, copied for every attention layer of the group."""
        from ..kernels import write_kv_cache

        for gid, src, dst, n in copies:
            self.num_kv_copies += 1
            for rows, g in self.ctx.indexer_views.values():  # one row per token, as MLA's
                if g == gid:
                    rows[dst, :n] = rows[src, :n]
            for k_cache, v_cache, g in self.attn_layers.values():
                if g != gid:
                    continue
                if v_cache is None:  # an MLA latent page: one row per token, no V
                    k_cache[dst, :n] = k_cache[src, :n]
                    continue
                bs = k_cache.shape[1]
                slots = dst * bs + torch.arange(n, dtype=torch.int64)
                write_kv_cache(k_cache[src, :n], v_cache[src, :n], k_cache, v_cache, slots)


def hf_greedy(
    model: torch.nn.Module, prompt: Sequence[int], max_new_tokens: int
) -> tuple[list[int], list[torch.Tensor]]:
    """The reference: greedy decoding by transformers alone (the cache its forward takes: a
    ``DynamicCache``, MiniMax's ``MiniMaxCache``; its own attention), one request at a time.
    A model with a state of its own (RWKV's ``state`` list, xLSTM's ``xLSTMCache``) builds its
    initial state itself and returns it, which the next forward is given back, as
    ``generate`` does. Returns the tokens and the logits row of each."""
    from . import hybrid_model_for

    kinds = hybrid_model_for(model.config).layer_kinds
    argument = cache_argument(kinds, model.forward)
    own_state = has_own_state(kinds)
    # RWKV and xLSTM build their initial state when given none; the others fill the cache given
    state = {} if own_state else {argument: cache_factory(model.config, kinds)()}
    ids = torch.tensor([list(prompt)])
    pos = torch.arange(len(prompt))[None]
    tokens: list[int] = []
    logits: list[torch.Tensor] = []
    with torch.no_grad():
        for _ in range(max_new_tokens):
            # explicit positions, as generate() passes them: Bamba's forward otherwise
            # numbers every call from 0, whatever the cache holds
            out = model(input_ids=ids, position_ids=pos, use_cache=True, **state)
            if own_state:
                state = {argument: getattr(out, argument)}
            row = out.logits[0, -1].float()
            tokens.append(int(row.argmax()))
            logits.append(row.clone())
            ids = torch.tensor([[tokens[-1]]])
            pos = pos[:, -1:] + 1
    return tokens, logits
