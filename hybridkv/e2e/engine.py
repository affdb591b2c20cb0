"""A small serving engine: a transformers hybrid model whose whole cache lives in a hybridkv
:class:`~hybridkv.plan.MemoryPlan`, with block ids from :class:`~hybridkv.alloc.HybridAllocator`.

One :meth:`Engine.step` follows the allocator's protocol (see :mod:`hybridkv.alloc.manager`):

1. admit waiting requests (``add_request``); a prefix hit's ``state_copies`` (checkpoint slot ->
   running slot) and ``kv_copies`` run at once, and only the uncached tail is computed; without
   a hit the running slot is zeroed (it holds whatever its last owner, or the NaN poison, left);
2. give every running request its next tokens (``allocate_slots``): the rest of its prompt in
   chunks that end where the checkpoint policy wants a state (``next_checkpoint``), or the one
   token it sampled last; when memory is full the newest request is preempted (``free``) and
   later re-added with its prompt plus what it generated so far, i.e. recomputed;
3. forward: one batched forward for all requests that bring one token (decode), one forward per
   request that brings more (prefill chunk). Around each, the batch's recurrent states are
   gathered from their slots (``gather_states``) into the ``DynamicCache`` that transformers'
   Mamba-2 / Gated DeltaNet layers read and update, and scattered back (``scatter_states``)
   after; attention goes through :mod:`.attn` (pages and block tables);
4. ``take_state_copies()`` and run them (running slot -> checkpoint slot), then greedy-sample
   and ``append_tokens`` / ``free`` finished requests.

State layouts differ between the plan (vLLM's) and transformers, and the engine converts:

- conv state: the plan slot holds ``[kernel - 1, conv_dim]``, HF's layer keeps
  ``[conv_dim, kernel]``. HF's decode (``causal_conv1d_update``) concatenates its ``kernel``
  columns with the new one and convolves, producing two outputs of which it keeps the last; the
  oldest column only feeds the discarded output. Its chunked path likewise keeps only the last
  ``kernel`` outputs of ``[state, new]`` convolved with ``kernel - 1`` left padding, and the first
  of those already starts at column 1. So ``kernel - 1`` columns are the whole state (vLLM stores
  exactly that); the gather puts a zero column in front (it only reaches outputs HF discards;
  zero keeps them finite) and the scatter drops it.
- Gated DeltaNet recurrent state: plan ``[v_heads, head_v_dim, head_k_dim]`` (vLLM >= 0.18), HF
  ``[v_heads, head_k_dim, head_v_dim]``: transposed both ways. Mamba-2's ``[heads, head_dim,
  d_state]`` is the same in both.

Every state is handed to HF as an already-started one (``has_previous_state``), a fresh request
with zeros, which is what HF's own prefill implies (zero left padding of the conv, zero initial
SSM state); one code path serves fresh requests, hits and chunk continuations alike.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from ..alloc import HitInfo, HybridAllocator, PoolExhausted
from ..plan import MemoryPlan
from . import attn, hybrid_model_for

__all__ = ["Engine", "Request", "hf_greedy"]

# state layers whose HF module keeps a (conv, recurrent) pair in a LinearAttentionLayer
_STATE_KINDS = ("mamba2", "gated_deltanet")


@dataclass
class Request:
    """A request as the engine tracks it. ``logits[i]`` is the fp32 logits row that chose
    ``output[i]``."""

    rid: str
    prompt: list[int]
    max_new_tokens: int
    output: list[int] = field(default_factory=list)
    logits: list[torch.Tensor] = field(default_factory=list)
    computed: int = 0  # tokens whose K/V and state are in the cache
    hits: list[HitInfo] = field(default_factory=list)  # one per admission
    preempted_at: list[int] = field(default_factory=list)  # outputs so far, per preemption

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output

    @property
    def done(self) -> bool:
        return len(self.output) >= self.max_new_tokens


@dataclass
class _StateLayer:
    """One recurrent layer: its HF layer index, state group and the plan's slot views."""

    idx: int
    gid: int
    conv: torch.Tensor  # [num_slots, kernel - 1, conv_dim]
    ssm: torch.Tensor  # [num_slots, *plan shape]
    ssm_transposed: bool  # plan and HF disagree on the order of the last two dims


class Engine:
    """Serve greedy generations of ``model`` out of ``plan``'s memory.

    ``poison``: fill the cache memory with NaN first, so any read of memory nothing wrote
    shows up in the logits. ``prefill_chunk``: the most prompt tokens one request computes per
    step. Remaining keyword arguments go to :class:`HybridAllocator` (``checkpoint_policy``,
    ``hash_block_size``, ...).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        plan: MemoryPlan,
        *,
        max_num_seqs: int | None = None,
        prefill_chunk: int = 64,
        poison: bool = True,
        **alloc_kwargs: Any,
    ) -> None:
        attn.register()
        self.model = model
        self.config = model.config
        self.plan = plan
        alloc_kwargs.setdefault("max_model_len", self.config.max_position_embeddings)
        # the engine's prefill writes a state only where a step ends, so it cannot export the
        # mid-prefill checkpoints vLLM's Mamba-2 / FlashInfer GDN kernels do: vLLM's scheduler
        # then splits the prefill at the checkpoint instead (prefill_checkpoint_alignment=None)
        alloc_kwargs.setdefault("prefill_checkpoint_alignment", None)
        if alloc_kwargs["prefill_checkpoint_alignment"] is not None:
            raise ValueError(
                "the engine's prefill cannot export states from inside a chunk; leave "
                "prefill_checkpoint_alignment unset (chunks then end where states are kept)"
            )
        self.alloc = HybridAllocator(plan, **alloc_kwargs)
        self.max_num_seqs = max_num_seqs or plan.config.max_num_seqs
        self.prefill_chunk = prefill_chunk
        # int8 -1 is 0xFF in every byte: NaN in fp32, fp16 and bf16
        self.buffers = plan.allocate("cpu", fill=-1 if poison else 0)
        self.ctx = attn.PagedContext(plan, self.buffers, [])
        spec = hybrid_model_for(self.config)
        self.state_layers: list[_StateLayer] = []
        for p in plan.state_placements:
            views = plan.state_views(self.buffers, p.layer)
            layer = spec.layer(p.layer)
            if layer.spec.kind not in _STATE_KINDS:
                raise NotImplementedError(
                    f"{p.layer}: {layer.spec.kind} layers are not wired to transformers' cache "
                    f"(supported: {', '.join(_STATE_KINDS)})"
                )
            self.state_layers.append(
                _StateLayer(
                    idx=layer.index,
                    gid=p.group_id,
                    conv=views["conv"],
                    ssm=views["ssm"],
                    ssm_transposed=layer.spec.kind == "gated_deltanet",
                )
            )
        self.attn_layers = {
            int(p.layer.split(".")[1]): (*plan.kv_views(self.buffers, p.layer), p.group_id)
            for p in plan.kv_placements
        }
        self.ctx.views = self.attn_layers
        types = set(getattr(self.config, "layer_types", None) or [])
        types |= set(getattr(self.config, "layers_block_type", None) or [])
        # a dict mask bypasses HF's mask construction: the paged kernels bound and mask
        # attention by position, and the recurrent layers see no padding
        self.masks = dict.fromkeys(types | {"full_attention", "linear_attention"})
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.finished: dict[str, Request] = {}
        self.num_steps = self.num_forwards = self.num_preemptions = 0
        self.num_state_copies = self.num_checkpoints = self.num_kv_copies = 0
        self.max_decode_batch = 0

    # ---- public ----------------------------------------------------------------------------
    def add_request(self, rid: str, prompt: Sequence[int], max_new_tokens: int) -> Request:
        req = Request(rid, list(prompt), max_new_tokens)
        self.waiting.append(req)
        return req

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def run(self, max_steps: int = 10_000) -> dict[str, Request]:
        """Step until every request has finished."""
        for _ in range(max_steps):
            if not self.has_work():
                return self.finished
            self.step()
        raise RuntimeError(f"requests still running after {max_steps} steps")

    def generate(
        self, prompts: dict[str, Sequence[int]], max_new_tokens: int
    ) -> dict[str, list[int]]:
        """Serve ``prompts`` (with those already queued) to the end; their outputs."""
        for rid, p in prompts.items():
            self.add_request(rid, p, max_new_tokens)
        self.run()
        return {rid: self.finished[rid].output for rid in prompts}

    # ---- one scheduler step ----------------------------------------------------------------
    def step(self) -> None:
        self.num_steps += 1
        preempted = self.num_preemptions
        plan = self._schedule_running()
        if self.num_preemptions == preempted:  # as vLLM: no admission in a step that preempts
            plan += self._admit()
        if not plan:
            raise RuntimeError("no request could be scheduled: the plan's memory is too small")
        sampled: list[Request] = []
        decode = [(r, n) for r, n in plan if n == 1]
        self.max_decode_batch = max(self.max_decode_batch, len(decode))
        if decode:
            sampled += self._forward(decode)
        for r, n in plan:
            if n > 1:
                sampled += self._forward([(r, n)])
        self._run_state_copies(self.alloc.take_state_copies(), checkpoint=True)
        for r in sampled:
            self.alloc.append_tokens(r.rid, r.output[-1:])
            if r.done:
                self.alloc.free(r.rid)
                self.running.remove(r)
                self.finished[r.rid] = r

    def _num_new(self, r: Request) -> int:
        """Tokens ``r`` computes this step: one to decode, else the next prefill chunk, cut
        where the checkpoint policy wants a state (``align``: block multiples)."""
        n = len(r.tokens) - r.computed
        if n > 1:
            n = min(n, self.prefill_chunk)
            ck = self.alloc.next_checkpoint(r.rid)
            if ck is not None and r.computed < ck < r.computed + n:
                n = ck - r.computed
        return n

    def _schedule_running(self) -> list[tuple[Request, int]]:
        """Slots for every running request, oldest first; when the pools are full the newest
        running request is preempted (possibly the one asking)."""
        plan: list[tuple[Request, int]] = []
        i = 0
        while i < len(self.running):
            r = self.running[i]
            n = self._num_new(r)
            while not self.alloc.allocate_slots(r.rid, n):
                victim = self.running[-1]
                self._preempt(victim)
                if victim is r:
                    break
            else:
                plan.append((r, n))
                i += 1
        return plan

    def _admit(self) -> list[tuple[Request, int]]:
        """Admit waiting requests in order while their first chunk fits."""
        plan: list[tuple[Request, int]] = []
        while self.waiting and len(self.running) < self.max_num_seqs:
            r = self.waiting[0]
            try:
                hit = self.alloc.add_request(r.rid, r.tokens)
            except PoolExhausted:
                break
            r.computed = hit.num_cached_tokens
            n = self._num_new(r)
            if not self.alloc.allocate_slots(r.rid, n):
                self.alloc.free(r.rid)  # stays waiting; its hit was never used
                break
            self.waiting.popleft()
            r.hits.append(hit)
            if hit.num_cached_tokens:
                self._run_state_copies(hit.state_copies, checkpoint=False)
                self._run_kv_copies(hit.kv_copies)
            else:
                self._zero_states(r)
            self.running.append(r)
            plan.append((r, n))
        return plan

    def _preempt(self, r: Request) -> None:
        """Free ``r`` and queue it first; it is recomputed from its prompt and outputs."""
        self.alloc.free(r.rid)
        self.running.remove(r)
        r.computed = 0
        r.preempted_at.append(len(r.output))
        self.num_preemptions += 1
        self.waiting.appendleft(r)

    # ---- forward ---------------------------------------------------------------------------
    def _forward(self, batch: list[tuple[Request, int]]) -> list[Request]:
        """One forward of ``batch`` (equal token counts) through the HF model; returns the
        requests that sampled a token (those that reached the end of their known tokens)."""
        from transformers import DynamicCache

        self.num_forwards += 1
        reqs = [r for r, _ in batch]
        t = batch[0][1]
        start = torch.tensor([r.computed for r in reqs], dtype=torch.int64)
        ids = torch.tensor([r.tokens[r.computed : r.computed + t] for r in reqs])
        pos = start[:, None] + torch.arange(t)
        tables = self.alloc.block_tables([r.rid for r in reqs])
        cache = DynamicCache(config=self.config)
        slots = self._load_states(cache, reqs)
        self.ctx.block_tables, self.ctx.start = tables, start
        with self._paged_attention(), torch.no_grad():
            out = self.model(
                input_ids=ids,
                position_ids=pos,
                past_key_values=cache,
                attention_mask=self.masks,
                use_cache=True,
                logits_to_keep=1,
            )
        self._store_states(cache, slots)
        logits = out.logits[:, -1].float()
        sampled = []
        for b, r in enumerate(reqs):
            r.computed += t
            if r.computed == len(r.tokens):
                r.logits.append(logits[b].clone())
                r.output.append(int(logits[b].argmax()))
                sampled.append(r)
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

    def _load_states(self, cache: Any, reqs: list[Request]) -> dict[int, torch.Tensor]:
        """Gather the batch's states from their slots into ``cache``'s recurrent layers."""
        from hybridkv_kernels.state_copy import gather_states

        slots: dict[int, torch.Tensor] = {}
        for s in self.state_layers:
            if s.gid not in slots:
                ids = [self.alloc.state_slot(r.rid, s.gid) for r in reqs]
                slots[s.gid] = torch.tensor(ids, dtype=torch.int64)
            ids = slots[s.gid]
            conv = gather_states(s.conv, ids)  # [B, K-1, C]
            ssm = gather_states(s.ssm, ids)
            hf_conv = torch.zeros(len(reqs), conv.shape[2], conv.shape[1] + 1, dtype=conv.dtype)
            hf_conv[:, :, 1:] = conv.transpose(1, 2)
            hf_ssm = ssm.transpose(-1, -2) if s.ssm_transposed else ssm
            layer = cache.layers[s.idx]
            layer.lazy_initialization(
                conv_states=hf_conv, recurrent_states=hf_ssm, conv_kernel_size=hf_conv.shape[2]
            )
            layer.conv_states[0].copy_(hf_conv)
            layer.recurrent_states[0].copy_(hf_ssm)
            layer.has_previous_state[0] = True
        return slots

    def _store_states(self, cache: Any, slots: dict[int, torch.Tensor]) -> None:
        """Scatter the updated states of ``cache`` back into their slots."""
        from hybridkv_kernels.state_copy import scatter_states

        for s in self.state_layers:
            layer = cache.layers[s.idx]
            conv = layer.conv_states[0][:, :, 1:].transpose(1, 2).contiguous()
            ssm = layer.recurrent_states[0]
            ssm = ssm.transpose(-1, -2).contiguous() if s.ssm_transposed else ssm.contiguous()
            scatter_states(s.conv, slots[s.gid], conv)
            scatter_states(s.ssm, slots[s.gid], ssm)

    # ---- copies ----------------------------------------------------------------------------
    def _zero_states(self, r: Request) -> None:
        """A request without a hit starts from zero state; its slot still holds its previous
        owner's state (or the NaN poison)."""
        from hybridkv_kernels.state_copy import scatter_states

        for s in self.state_layers:
            ids = torch.tensor([self.alloc.state_slot(r.rid, s.gid)], dtype=torch.int64)
            for pool in (s.conv, s.ssm):
                scatter_states(pool, ids, torch.zeros((1, *pool.shape[1:]), dtype=pool.dtype))

    def _run_state_copies(self, copies: list[tuple[int, int, int]], *, checkpoint: bool) -> None:
        """``(group, src slot, dst slot)`` for every state layer of the group."""
        from hybridkv_kernels.state_copy import copy_states

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
        for s in self.state_layers:
            if s.gid in by_group:
                src, dst = (torch.tensor(x, dtype=torch.int64) for x in by_group[s.gid])
                copy_states(s.conv, src, dst)
                copy_states(s.ssm, src, dst)

    def _run_kv_copies(self, copies: list[tuple[int, int, int, int]]) -> None:
        """``(group, src block, dst block, num_tokens)``: the first tokens of a partly reused
        block, copied for every attention layer of the group."""
        from hybridkv_kernels.cache_write import write_kv_cache

        for gid, src, dst, n in copies:
            self.num_kv_copies += 1
            for k_cache, v_cache, g in self.attn_layers.values():
                if g != gid:
                    continue
                bs = k_cache.shape[1]
                slots = dst * bs + torch.arange(n, dtype=torch.int64)
                write_kv_cache(k_cache[src, :n], v_cache[src, :n], k_cache, v_cache, slots)


def hf_greedy(
    model: torch.nn.Module, prompt: Sequence[int], max_new_tokens: int
) -> tuple[list[int], list[torch.Tensor]]:
    """The reference: greedy decoding by transformers alone (its own ``DynamicCache``, its own
    attention), one request at a time. Returns the tokens and the logits row of each."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    ids = torch.tensor([list(prompt)])
    pos = torch.arange(len(prompt))[None]
    tokens: list[int] = []
    logits: list[torch.Tensor] = []
    with torch.no_grad():
        for _ in range(max_new_tokens):
            # explicit positions, as generate() passes them: Bamba's forward otherwise
            # numbers every call from 0, whatever the cache holds
            out = model(input_ids=ids, position_ids=pos, past_key_values=cache, use_cache=True)
            row = out.logits[0, -1].float()
            tokens.append(int(row.argmax()))
            logits.append(row.clone())
            ids = torch.tensor([[tokens[-1]]])
            pos = pos[:, -1:] + 1
    return tokens, logits
