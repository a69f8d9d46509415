"""The module ``parallelize`` returns: the rewritten graph, its local shards, and its plan.

``TPModule`` registers the rewritten GraphModule's submodules as its own, so parameter and
buffer names (``state_dict`` keys, optimizer param groups) are exactly the original model's,
while ``forward`` runs the rewritten graph. Local shards are ordinary ``nn.Parameter`` objects:
any ``torch.optim`` optimizer works on them, and ``torch.compile`` traces straight through.
"""

from __future__ import annotations

from collections import OrderedDict

import torch
import torch.distributed as dist
from torch import fx, nn
from torch.distributed.tensor import DTensor

from tpcompile.errors import CaptureError, TPCompileError
from tpcompile.runtime.calls import CallCheck
from tpcompile.runtime.inputs import InputSpec
from tpcompile.runtime.compiled_blocks import compiled_blocks_graph
from tpcompile.runtime.signatures import MAX_SIGNATURES, bind_tensors, exact_fit, written_buffers
from tpcompile.core.placement import Shard
from tpcompile.core.plan import ShardingPlan

__all__ = ["TPModule", "gather_full"]


class TPModule(nn.Module):
    """A tensor-parallel module: this rank's shards plus the graph that uses them."""

    def __init__(self, gm: fx.GraphModule, plan: ShardingPlan, rank: int, group,
                 check_calls: str = "new", checkpointed_regions: tuple[str, ...] = (),
                 skeleton_capture=None, capture_signature=None,
                 reused_blocks: tuple[str, int] | None = None):
        super().__init__()
        for name, child in gm.named_children():
            self.add_module(name, child)
        for name, p in gm.named_parameters(recurse=False):
            self.register_parameter(name, p)
        for name, b in gm.named_buffers(recurse=False):
            self.register_buffer(name, b, persistent=name not in gm._non_persistent_buffers_set)
        # one dict for both: a root tensor replaced on the module (FSDP2's fully_shard, to(),
        # to_empty()) is the one the graph's get_attr reads
        gm._parameters, gm._buffers = self._parameters, self._buffers
        object.__setattr__(self, "graph_module", gm)  # not a child: names stay the model's
        self.plan, self.rank, self.group = plan, rank, group
        # the names of the checkpointed regions recomputed in backward (activation_checkpointing)
        self.checkpointed_regions = checkpointed_regions
        # (block list path, blocks) when the capture repeated blocks (core.stamp), else None
        self.reused_blocks = reused_blocks
        object.__setattr__(self, "input_spec", InputSpec.of(gm))  # what a call must look like
        # ranks agree on each new call before the graph's collectives (a collective itself:
        # every rank of the group constructs its TPModule at the same point, in parallelize)
        object.__setattr__(self, "call_check", CallCheck(group, check_calls))
        # further (input spec, graph) pairs, one per call signature (see runtime.signatures);
        # capture_signature(args, kwargs) -> (a rewritten graph, its plan), given by parallelize
        object.__setattr__(self, "signatures", [])
        object.__setattr__(self, "capture_signature", capture_signature)
        # the same, on a meta copy of the model, for generate()'s static-cache wrapper
        object.__setattr__(self, "skeleton_capture", skeleton_capture)
        # torch.compile arguments for generate()'s decode steps (compile_generation)
        object.__setattr__(self, "generation_compile", None)
        # generate()'s static-cache modules by (batch, cache length), least recently used
        # first (runtime/cache_modules.py)
        object.__setattr__(self, "generation_modules", OrderedDict())
        # opt-in: torch.compile(tp, options=tpcompile.compile_options(compiled_blocks=True))
        # must go with it (inductor's buffer reuse is wrong there in torch 2.13; the backend
        # does both)
        self.compiled_blocks = False

    @property
    def compiled_blocks(self) -> bool:
        """Whether a compiled call runs :attr:`compiled_blocks_graph_module`."""
        return self.__dict__["_compiled_blocks"]

    @compiled_blocks.setter
    def compiled_blocks(self, on: bool) -> None:
        if on:  # outlined now, outside the trace a compiled call starts
            self._outlined()
        object.__setattr__(self, "_compiled_blocks", bool(on))

    def _outlined(self) -> tuple[fx.GraphModule, int]:
        """What a compiled call runs: identical blocks outlined into calls of one compiled
        block, so Dynamo/AOT/inductor compile one block body, not one per layer
        (runtime/compiled_blocks.py). Built on first use: most modules (generate's captures,
        eager training) never run it."""
        if "_outlined_blocks" not in self.__dict__:
            object.__setattr__(self, "_outlined_blocks", compiled_blocks_graph(self.graph_module))
        return self.__dict__["_outlined_blocks"]

    compiled_blocks_graph_module = property(lambda self: self._outlined()[0])
    compiled_block_calls = property(lambda self: self._outlined()[1])

    # the documented former names of the three attributes above (docs/compile.md)
    compile_regions = property(lambda self: self.compiled_blocks,
                               lambda self, on: setattr(self, "compiled_blocks", on))
    region_calls = property(lambda self: self.compiled_block_calls)
    regional_graph_module = property(lambda self: self.compiled_blocks_graph_module)

    def forward(self, *args, **kwargs):
        if self.plan.inference_only and not torch.compiler.is_compiling():
            self._refuse_backward(args, kwargs)
        if not torch.compiler.is_compiling():  # compiled: the graph's own guards only
            # an InputError (or, ranks disagreeing, an InputMismatchError on every rank), not
            # a failure deep inside the graph or a collective pairing mismatched buffers
            spec, gm = self._graph_for(args, kwargs)
            self.call_check(spec, args, kwargs)
            outputs = gm(*args, **kwargs)
            self.call_check.check_random()
            self.call_check.track_backward(outputs)
            return outputs
        if self.compiled_blocks:
            return self.compiled_blocks_graph_module(*args, **kwargs)
        return self._graph_for(args, kwargs)[1](*args, **kwargs)

    def _refuse_backward(self, args, kwargs) -> None:
        """An inference-only graph (custom autograd Functions traced through) refuses a call
        a backward could follow: grad enabled, and a trainable shard or an input that
        requires grad."""
        if not torch.is_grad_enabled():
            return
        inputs = torch.utils._pytree.tree_leaves((args, kwargs))
        if (any(p.requires_grad for p in self.parameters())
                or any(isinstance(t, torch.Tensor) and t.requires_grad for t in inputs)):
            raise CaptureError(
                f"this module is {self.plan.inference_only}; a call with grad enabled could "
                "train through them\n  hint: call it under torch.no_grad() (or freeze it with "
                "requires_grad_(False)); to train, register those Functions as custom ops "
                "(torch.library.custom_op with register_autograd)")

    def _graph_for(self, args: tuple, kwargs: dict):
        """The graph captured for this call's signature; a new capture for a new signature
        of the same call (a one-token decode step after a prefill), sharing every tensor."""
        pairs = [(self.input_spec, self.graph_module)] + self.signatures
        if self.capture_signature is None:
            return pairs[0]
        fits = [exact_fit(spec, args, kwargs) for spec, _ in pairs]
        if True in fits:
            return pairs[fits.index(True)]
        if fits[0] is None or len(self.signatures) >= MAX_SIGNATURES:
            return pairs[0]  # the call check names what is wrong with the call
        # local: no collective before the call check
        gm, plan = self.capture_signature(args, kwargs)
        bind_tensors(gm, self, plan)
        self.signatures.append((InputSpec.of(gm), gm))
        return self.signatures[-1]

    def generate(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                 generation_config=None, **kwargs) -> torch.Tensor:
        """``model.generate`` of a Hugging Face causal LM, on this rank's shards (call on all).

        ``max_new_tokens``, ``do_sample``, ``temperature``, ``top_k``, ``top_p``,
        ``eos_token_id``, ``pad_token_id`` or a ``generation_config``, as for ``generate``;
        left-padded batches with their ``attention_mask``. A static KV cache sharded on kv
        heads is captured once per batch size and cache bucket, whatever the prompt length
        (see tpcompile.runtime.cache_modules); its graphs read this module's parameters, so a
        training step's updates are used.
        Returns the prompts followed by the new tokens, the same on every rank.
        """
        from tpcompile.runtime.generation import generate
        return generate(self, input_ids, attention_mask, generation_config, **kwargs)

    def compile_generation(self, **compile_kwargs) -> None:
        """Make :meth:`generate` run its one-token decode steps through ``torch.compile(...,
        **compile_kwargs)`` (e.g. ``options=tpcompile.compile_options()``, or
        ``mode="reduce-overhead"`` on CUDA). The prefill stays eager; the decode step is
        captured eagerly on its first call, then compiled (a capture cannot run inside a
        compiled call). Tokens are the eager ones."""
        object.__setattr__(self, "generation_compile", dict(compile_kwargs))
        for inner in self.generation_modules.values():
            inner.__dict__.pop("compiled_decode", None)

    def reset_caches(self) -> None:
        """Zero every buffer the graphs write in place (a static KV cache), on this rank."""
        for buffers, leaf in self.cache_slots():
            buffers[leaf].zero_()

    def cache_slots(self) -> list[tuple[dict, str]]:
        """Where each buffer the graphs write in place (a static KV cache) is held: its owner's
        buffer dict and its name there, in graph order.

        The names are found once, by a walk of the first graph's nodes (every graph writes the
        same cache), and kept: ``generate`` resets the cache on every call, and a walk per call
        would cost Python per node, growing with the layer count. The dicts are looked up on
        each call, so a buffer replaced since (``to()``, a released cache) is the one found."""
        names = self.__dict__.get("_cache_buffers")
        if names is None:
            names = self.__dict__["_cache_buffers"] = written_buffers(self.graph_module)
        slots = []
        for name in names:
            owner, _, leaf = name.rpartition(".")
            slots.append(((self.get_submodule(owner) if owner else self)._buffers, leaf))
        return slots

    def _apply(self, fn, recurse=True):
        """``to`` / ``to_empty`` / ``float`` may replace tensors: the first graph shares this
        module's dicts, the graphs of further call signatures are bound again."""
        super()._apply(fn, recurse)
        for _, gm in self.signatures:
            bind_tensors(gm, self)
        self.generation_modules.clear()  # generate() captures and binds them again
        return self

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """torch's, for this rank's shards (a round trip of ``state_dict()`` at this world size).

        A full, unsharded state dict (``model.state_dict()``) is refused by name instead of with
        torch's size-mismatch error, pointing at the call that slices it.
        """
        whole = [name for name, value in state_dict.items() if self._is_unsharded(name, value)]
        if whole:
            raise TPCompileError(
                f"load_state_dict got the unsharded {whole[0]} ({list(state_dict[whole[0]].shape)}"
                f"; this rank's shard is {list(self.state_dict()[whole[0]].shape)}), "
                f"{len(whole)} such tensor(s) in all\n  hint: load a full state dict with "
                "tpcompile.load_full_state_dict(tp, state_dict), which copies this rank's slices")
        return super().load_state_dict(state_dict, strict, assign)

    def _is_unsharded(self, fqn: str, value) -> bool:
        """``value`` has the global shape of a tensor whose shard here is smaller."""
        entry = self.plan.by_fqn.get(fqn)
        return (entry is not None and tuple(getattr(value, "shape", ())) == entry.global_shape
                != entry.local_shapes[self.rank])

    def full_state_dict(self, rank: int | None = None) -> dict[str, torch.Tensor]:
        """The unsharded state dict, gathered from every rank (a collective: call on all).

        ``rank=k`` (a rank of the group): only rank k receives it, the others get ``{}``.
        """
        out = {}
        for name, t in self.state_dict().items():
            full = gather_full(t, self._placement(name), self.plan, self.group, dst=rank)
            if full is not None:
                out[name] = full
        return out

    def full_grads(self) -> dict[str, torch.Tensor]:
        """Unsharded gradients of every parameter (a collective: call on all ranks). After
        FSDP2 (``fully_shard_blocks``) a gradient is a DTensor over the data-parallel mesh:
        it is gathered over that mesh first, then over the tensor-parallel group."""
        return {name: gather_full(_local(_grad(p)), self._placement(name), self.plan, self.group)
                for name, p in self.named_parameters() if _grad(p) is not None}

    def _placement(self, fqn: str):
        entry = self.plan.by_fqn.get(fqn)
        return None if entry is None else entry.placement


def _grad(p: torch.Tensor) -> torch.Tensor | None:
    """``p``'s gradient, and an empty one for a 0-element placeholder: an expert another rank
    holds whole, whose work this rank's graph drops (so autograd gives it none), still takes
    part in the gathers every rank makes."""
    return torch.zeros_like(p) if p.grad is None and p.numel() == 0 else p.grad


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's tensor-parallel shard: a DTensor (FSDP2's) gathered over its own mesh."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def gather_full(local: torch.Tensor, placement, plan: ShardingPlan, group,
                dst: int | None = None) -> torch.Tensor | None:
    """Reassemble a full tensor from every rank's shard (identity for replicated tensors).

    With ``dst`` (a rank of ``group``) only that rank receives it; the others get None. A
    float8 tensor (torchao's qdata) moves as its bytes: gloo has no float8 type.
    """
    if local.is_floating_point() and local.element_size() == 1:
        full = gather_full(local.view(torch.uint8), placement, plan, group, dst)
        return None if full is None else full.view(local.dtype)
    if dst is not None and dist.get_rank(group) != dst:
        if isinstance(placement, Shard):
            dist.gather(_padded(local, placement, plan), None, group=group, group_dst=dst)
        return None
    if not isinstance(placement, Shard):
        return local.detach().clone()
    ranges = plan.specs.ranges(placement.layout)
    moved = _padded(local, placement, plan)
    parts = [torch.empty_like(moved) for _ in ranges]
    if dst is None:
        dist.all_gather(parts, moved, group=group)
    else:
        dist.gather(moved, parts, group=group, group_dst=dst)
    full = moved.new_empty((placement.layout.size,) + tuple(moved.shape[1:]))
    for part, held in zip(parts, ranges):
        pos = 0
        for s, e in held:
            full[s:e] = part[pos:pos + e - s]
            pos += e - s
    return full.movedim(0, placement.dim)


def _padded(local: torch.Tensor, placement: Shard, plan: ShardingPlan) -> torch.Tensor:
    """The shard with its dim first, zero-padded to the largest shard (collectives need one size)."""
    width = max(sum(e - s for s, e in r) for r in plan.specs.ranges(placement.layout))
    moved = local.detach().movedim(placement.dim, 0).contiguous()
    if moved.shape[0] < width:
        pad = moved.new_zeros((width - moved.shape[0],) + tuple(moved.shape[1:]))
        moved = torch.cat([moved, pad])
    return moved
