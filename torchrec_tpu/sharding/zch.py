"""Managed collisions (ZCH): one table's raw int64 ids -> its slots, as TorchRec's ``MCHManagedCollisionModule``.

The state is TorchRec's: a sorted identity table (raw id per slot, ``INT64_MAX`` where empty),
the slot each entry maps to, the policy's per-slot metadata (counts, last access), the ids seen
since the last eviction (a history buffer sized at the first batch, ``numel * interval * 1.25``,
ids past its end dropped, as TorchRec drops them) and the iteration counter. Every
``eviction_interval`` batches the history is coalesced and TorchRec's own eviction policy
(:class:`~torchrec.modules.mc_modules.LFU_EvictionPolicy`, ``LRU_``, ``DistanceLFU_``, with their
threshold filters) picks which slots change hands; those slots are reported once
(:meth:`TableRemap.take_evicted`) so their rows and optimizer state can be reset. An id not in
the table maps to the last slot (TorchRec's default slot, never handed out).

Unlike TorchRec's module, an eviction never writes a tensor a :class:`RemapMark` still holds,
so a mark taken after any batch (O(1), references only) restores the state as of that batch:
a prefetch thread can remap ahead of training and a checkpoint still saves the trained state.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial

import numpy as np
import torch
from torchrec.modules.mc_modules import (
    DistanceLFU_EvictionPolicy,
    LFU_EvictionPolicy,
    LRU_EvictionPolicy,
    MCHEvictionPolicy,
    MCHManagedCollisionModule,
    average_threshold_filter,
    dynamic_threshold_filter,
)

from torchrec_tpu.zch_names import ZCH_POLICIES

INT64_MAX = torch.iinfo(torch.int64).max
POLICIES = dict(zip(ZCH_POLICIES, (LFU_EvictionPolicy, LRU_EvictionPolicy, DistanceLFU_EvictionPolicy)))
THRESHOLDS = ("dynamic", "average")
# an input_hash_size under which TorchRec's routing sends id i >= 0 to rank i mod W: balanced for any
# raw-id distribution, where its default (2**63 - 1) sends every id below 2**62 to rank 0
MOD_ROUTING = 1


@dataclass(frozen=True)
class ZchSpec:
    """One table's managed collisions: eviction ``policy`` (a key of ``POLICIES``) every
    ``eviction_interval`` batches; ``decay_exponent`` of the distance (``lru``, ``distance_lfu``);
    ``threshold``: TorchRec's filter of the ids admitted at an eviction (``dynamic``: count >
    mean * ``threshold_skew_multiplier``; ``average``: count > mean; None: all);
    ``input_hash_size``: TorchRec's input range, which routes a row-wise table's ids to the ranks
    (:func:`owner_ranks`)."""

    policy: str = "lfu"
    eviction_interval: int = 1
    decay_exponent: float = 1.0
    threshold: str | None = None
    threshold_skew_multiplier: float = 10.0
    input_hash_size: int = INT64_MAX

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"zch policy must be one of {sorted(POLICIES)}, got {self.policy!r}")
        if self.eviction_interval < 1:
            raise ValueError(f"zch eviction_interval must be >= 1, got {self.eviction_interval}")
        if self.threshold is not None and self.threshold not in THRESHOLDS:
            raise ValueError(f"zch threshold must be one of {THRESHOLDS} or none, got {self.threshold!r}")
        if self.policy == "lfu" and self.decay_exponent != 1.0:
            raise ValueError(f"zch decay_exponent applies to lru and distance_lfu, not lfu (got {self.decay_exponent})")
        if not 1 <= self.input_hash_size <= INT64_MAX:
            raise ValueError(f"zch input_hash_size must lie in [1, 2**63 - 1], got {self.input_hash_size}")

    @classmethod
    def of_torchrec(cls, module: MCHManagedCollisionModule) -> "ZchSpec":
        """The spec of TorchRec's ``module``: its policy, interval, decay and threshold filter
        (TorchRec's own filters only; ids hashed by an ``input_hash_func`` are refused)."""
        name = getattr(module, "_name", None) or "an MCH module"
        if module._input_hash_func is not None:
            raise ValueError(f"zch of {name}: an input_hash_func is not supported (raw ids are remapped as given)")
        policy = module._eviction_policy
        kind = next((key for key, value in POLICIES.items() if type(policy) is value), None)
        if kind is None:
            raise ValueError(f"zch of {name}: eviction policy {type(policy).__name__} is not one of "
                             f"{[p.__name__ for p in POLICIES.values()]}")
        found = policy._threshold_filtering_func
        threshold, multiplier = None, 10.0
        if found is average_threshold_filter:
            threshold = "average"
        elif found is dynamic_threshold_filter or getattr(found, "func", None) is dynamic_threshold_filter:
            threshold = "dynamic"
            multiplier = float(getattr(found, "keywords", {}).get("threshold_skew_multiplier", multiplier))
        elif found is not None:
            raise ValueError(f"zch of {name}: threshold filter {found!r} is not TorchRec's average or dynamic one")
        return cls(kind, module._eviction_interval, float(getattr(policy, "_decay_exponent", 1.0)), threshold,
                   multiplier, module._input_hash_size)

    def eviction_policy(self) -> MCHEvictionPolicy:
        """TorchRec's eviction policy object for this spec."""
        dynamic = partial(dynamic_threshold_filter, threshold_skew_multiplier=self.threshold_skew_multiplier)
        filters = {None: None, "average": average_threshold_filter, "dynamic": dynamic}
        kwargs = {} if self.policy == "lfu" else {"decay_exponent": self.decay_exponent}
        return POLICIES[self.policy](threshold_filtering_func=filters[self.threshold], **kwargs)


def owner_ranks(ids: torch.Tensor, input_hash_size: int, world_size: int) -> torch.Tensor:
    """The rank whose slots each raw id of a row-wise table maps to, as TorchRec's sharded MCH
    routes it (FBGEMM's block bucketize: ``id // ceil(input_hash_size / W)``, ids past the range
    and negative ones, as unsigned, by ``id mod W``)."""
    block = torch.tensor([-(-input_hash_size // world_size)])
    counts, _, _, _, permute = torch.ops.fbgemm.block_bucketize_sparse_features(
        torch.tensor([ids.numel()]), ids, False, True, block, world_size, None,
        total_num_blocks=torch.tensor([world_size]), keep_orig_idx=True)
    return torch.repeat_interleave(torch.arange(world_size), counts)[permute]


@dataclass(frozen=True)
class RemapMark:
    """A :class:`TableRemap`'s state after some batch (references to tensors no later batch writes)."""

    sorted_ids: torch.Tensor
    slot_of: torch.Tensor
    metadata: dict[str, torch.Tensor]
    history: torch.Tensor | None
    history_iters: torch.Tensor | None
    fill: int
    iteration: int
    last_eviction: int


@dataclass
class TableRemap:
    """Raw int64 ids of one table (shard) -> slots ``[offset, offset + slots)`` by ``spec``."""

    slots: int
    spec: ZchSpec = ZchSpec()
    offset: int = 0
    _policy: MCHEvictionPolicy = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if self.slots < 2:
            raise ValueError(f"a zch table needs >= 2 rows (one is the default slot of unseen ids), got {self.slots}")
        self._policy = self.spec.eviction_policy()
        # TorchRec's policy picks by a full argsort of every slot's score; the same picks, in O(slots)
        self._policy._compute_selected_eviction_and_replacement_indices = select_evictions  # type: ignore[method-assign]
        self._tracks_access = any(info.is_history_metadata for info in self._policy.metadata_info)
        self.sorted_ids = torch.full((self.slots,), INT64_MAX, dtype=torch.int64)
        self.slot_of = torch.arange(self.offset, self.offset + self.slots, dtype=torch.int64)
        self.metadata = {info.metadata_name: torch.zeros(self.slots, dtype=torch.int64)
                         for info in self._policy.metadata_info if info.is_mch_metadata}
        self.history: torch.Tensor | None = None
        self.history_iters: torch.Tensor | None = None
        self.fill = self.iteration = self.last_eviction = 0
        self._evicted: torch.Tensor | None = None

    @property
    def default_slot(self) -> int:
        """Where an id outside the table goes."""
        return self.offset + self.slots - 1

    def __call__(self, ids: torch.Tensor, training: bool = True) -> torch.Tensor:
        """The slots of ``ids`` (int64, 1-D); in training the batch first counts toward the
        policy and may trigger an eviction, as TorchRec's ``profile`` then ``remap``."""
        if training:
            self._profile(ids)
        return self.lookup(ids)

    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        """The slots of ``ids`` in the current table, no state change (inference)."""
        table, wanted = self.sorted_ids.numpy(), ids.numpy()
        order = np.argsort(wanted)  # searched in order, each search starts where the last ended: half the time
        keys = wanted[order]
        at = np.searchsorted(table[:-1], keys)
        slots = np.empty(keys.size, dtype=np.int64)
        slots[order] = np.where(table[at] == keys, self.slot_of.numpy()[at], self.default_slot)
        return torch.from_numpy(slots)

    def take_evicted(self) -> torch.Tensor | None:
        """The slots whose ids changed since the last call (sorted, unique; None: no eviction ran)."""
        evicted, self._evicted = self._evicted, None
        return evicted

    def open_slots(self) -> int:
        """Slots never handed out (the default slot excluded)."""
        return self.slots - 1 - int(torch.searchsorted(self.sorted_ids, INT64_MAX))

    def _profile(self, ids: torch.Tensor) -> None:
        self.iteration += 1
        if self.history is None:
            self._new_history(int(ids.numel() * self.spec.eviction_interval * 1.25))
        taken = ids[: self.history.numel() - self.fill]
        end = self.fill + taken.numel()
        self.history[self.fill:end] = taken
        if self.history_iters is not None:
            self.history_iters[self.fill:end] = self.iteration
        self.fill = end
        if self.iteration - self.last_eviction == self.spec.eviction_interval:
            self._evict()
            self.last_eviction = self.iteration

    def _new_history(self, capacity: int) -> None:
        self.history = torch.empty(capacity, dtype=torch.int64)
        self.history_iters = torch.zeros(capacity, dtype=torch.int64) if self._tracks_access else None
        self.fill = 0

    @torch.no_grad()
    def _evict(self) -> None:
        # (the inverse serves the last access of each id; LFU has none)
        found = np.unique(self.history[:self.fill].numpy(), return_inverse=self._tracks_access, return_counts=True)
        ids, counts = torch.from_numpy(found[0]), torch.from_numpy(found[-1])
        inverse = torch.from_numpy(found[1]) if self._tracks_access else None
        keep = None
        if self._policy._threshold_filtering_func is not None:
            keep, _ = self._policy._threshold_filtering_func(counts)
        access = {"last_access_iter": self.history_iters[:self.fill]} if self._tracks_access else {}
        history_metadata = self._policy.coalesce_history_metadata(self.iteration, access, counts, inverse,
                                                                  threshold_mask=keep)
        if keep is not None:
            ids, counts = ids[keep], counts[keep]
        # ids ascend here, so the search walks the table once; then ordered by count, as TorchRec orders them
        at = torch.from_numpy(np.searchsorted(self.sorted_ids.numpy()[:-1], ids.numpy()))
        by_count = torch.from_numpy(np.argsort(-counts.numpy(), kind="stable"))  # (counts > 0: descending, stable)
        ids, counts, at = ids[by_count], counts[by_count], at[by_count]
        known = self.sorted_ids[at] == ids
        metadata = {name: value.clone() for name, value in self.metadata.items()}  # marks keep the old ones
        evicted, admitted = self._policy.update_metadata_and_generate_eviction_scores(
            self.iteration, self.slots, by_count, counts, known, at[known], metadata, history_metadata)
        sorted_ids = self.sorted_ids.numpy().copy()
        sorted_ids[evicted.numpy()] = ids[~known][admitted].numpy()
        slots = self.slot_of[evicted]
        self._evicted = slots.sort().values if self._evicted is None else torch.unique(torch.cat([self._evicted,
                                                                                                 slots]))
        order = merge_order(sorted_ids, evicted.numpy())
        self.sorted_ids, self.slot_of = torch.from_numpy(sorted_ids[order]), _take(self.slot_of, order)
        self.metadata = {name: _take(value, order) for name, value in metadata.items()}
        self._new_history(self.history.numel())

    def mark(self) -> RemapMark:
        """The state now, restorable by :meth:`restore` while later batches go on."""
        return RemapMark(self.sorted_ids, self.slot_of, dict(self.metadata), self.history, self.history_iters,
                         self.fill, self.iteration, self.last_eviction)

    def restore(self, mark: RemapMark) -> None:
        """Back to ``mark``'s state (its history copied: this table appends to it again)."""
        self.sorted_ids, self.slot_of, self.metadata = mark.sorted_ids, mark.slot_of, dict(mark.metadata)
        self.history = None if mark.history is None else mark.history.clone()
        self.history_iters = None if mark.history_iters is None else mark.history_iters.clone()
        self.fill, self.iteration, self.last_eviction = mark.fill, mark.iteration, mark.last_eviction
        self._evicted = None

    def state_dict(self, mark: RemapMark | None = None) -> dict[str, torch.Tensor]:
        """The state now (or at ``mark``) as tensors: TorchRec's buffer names, plus the history
        TorchRec does not save (so a resumed run evicts exactly as one that never stopped)."""
        m = mark or self.mark()
        state = {"_mch_sorted_raw_ids": m.sorted_ids, "_mch_remapped_ids_mapping": m.slot_of,
                 "_current_iter_tensor": torch.tensor([m.iteration]),
                 "_last_eviction_iter": torch.tensor([m.last_eviction]),
                 "_history": torch.empty(0, dtype=torch.int64) if m.history is None else m.history[:m.fill].clone(),
                 "_history_capacity": torch.tensor([-1 if m.history is None else m.history.numel()])}
        state.update({f"_mch_{name}": value for name, value in m.metadata.items()})
        if m.history_iters is not None:
            state["_history_last_access_iter"] = m.history_iters[:m.fill].clone()
        return state

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Install a :meth:`state_dict` (or a TorchRec ``MCHManagedCollisionModule``'s buffers,
        whose history was not saved: it starts empty and the next eviction is an interval away)."""
        if state["_mch_sorted_raw_ids"].shape != (self.slots,):
            raise ValueError(f"zch state has {state['_mch_sorted_raw_ids'].numel()} slots, the table {self.slots}")
        order = torch.argsort(state["_mch_sorted_raw_ids"], stable=True)
        self.sorted_ids = state["_mch_sorted_raw_ids"].to(torch.int64)[order]
        self.slot_of = state["_mch_remapped_ids_mapping"].to(torch.int64)[order]
        self.metadata = {name: state[f"_mch_{name}"].to(torch.int64)[order] for name in self.metadata}
        self.iteration = int(state["_current_iter_tensor"].item())
        self.last_eviction = int(state.get("_last_eviction_iter", state["_current_iter_tensor"]).item())
        capacity = int(state.get("_history_capacity", torch.tensor([-1])).item())
        self.history = self.history_iters = None
        self.fill = 0
        if capacity >= 0:
            self._new_history(capacity)
            saved = state["_history"]
            self.fill = saved.numel()
            self.history[:self.fill] = saved
            if self.history_iters is not None:
                self.history_iters[:self.fill] = state["_history_last_access_iter"]
        self._evicted = None


@dataclass(frozen=True)
class RoutedLookup:
    """A row-wise table's frozen remap over its ``shards``' remaps, in rank order (inference):
    an id goes to the shard :func:`owner_ranks` routes it to, whose slot k is the table's row
    ``rank + k * W`` (the row-wise layout), a miss to that shard's default slot."""

    shards: tuple[TableRemap, ...]
    input_hash_size: int

    def __call__(self, ids: torch.Tensor, training: bool = False) -> torch.Tensor:
        if training:
            raise ValueError("a zch remap read from a checkpoint of several ranks is frozen: inference only")
        world = len(self.shards)
        owners = owner_ranks(ids, self.input_hash_size, world)
        rows = torch.empty_like(ids)
        for rank, remap in enumerate(self.shards):
            at = owners == rank
            rows[at] = remap.lookup(ids[at]) * world + rank
        return rows

    def take_evicted(self) -> None:
        """Nothing: a frozen remap evicts nothing."""


def _take(values: torch.Tensor, order: np.ndarray) -> torch.Tensor:
    """``values[order]`` (numpy's gather: a fraction of torch's indexing cost on one thread)."""
    return torch.from_numpy(values.numpy()[order])


def select_evictions(pivot: int, scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """TorchRec's ``_compute_selected_eviction_and_replacement_indices``: of ``scores`` (the
    ``pivot`` slots', then the new ids'), the top ``pivot`` by (score descending, index) stay;
    returns (the slots that fall out, the new ids that get in), each in that order. Here the
    cut is read from a plain sort (numpy's SIMD one) of the entries that can fall out, and only
    those at or below it are ranked, instead of a stable argsort of all of them."""
    values = scores.numpy()
    extra = values.size - pivot
    if extra <= 0:
        empty = torch.zeros(0, dtype=torch.int64)
        return empty, empty
    # the cut is no higher than the highest new score (the new ones alone are ``extra`` entries)
    low = np.flatnonzero(values <= values[pivot:].max())
    low_values = values[low]
    kth = np.sort(low_values)[extra - 1]  # (np.partition degrades on the many equal counts LFU has)
    below = low[low_values < kth]
    tied = low[low_values == kth]
    # the lowest ranks: every score under the cut, then the ties with the highest indices
    out = np.sort(np.concatenate([below, tied[tied.size - (extra - below.size):]]))
    evicted = out[out < pivot]
    stays = np.ones(extra, dtype=bool)
    stays[out[out >= pivot] - pivot] = False
    new = np.flatnonzero(stays) + pivot
    return torch.from_numpy(_by_rank(values, evicted)), torch.from_numpy(_by_rank(values, new) - pivot)


def _by_rank(values: np.ndarray, at: np.ndarray) -> np.ndarray:
    """``at`` (ascending) ordered by score descending, index ascending (a stable descending sort)."""
    picked = values[at]
    # a stable ascending sort of the reversed run, reversed: descending, equal scores by index
    return at[::-1][np.argsort(picked[::-1], kind="stable")][::-1].copy()


def resorted(ids: torch.Tensor, replaced: torch.Tensor) -> torch.Tensor:
    """``torch.argsort(ids, stable=True)`` of an ascending ``ids`` whose entries at ``replaced``
    were overwritten with values none of the others has: the untouched entries stay in order and
    the new ones are merged in (O(n + k log k), not a sort of all n)."""
    return torch.from_numpy(merge_order(ids.numpy(), replaced.numpy()))


def merge_order(ids: np.ndarray, replaced: np.ndarray) -> np.ndarray:
    """:func:`resorted` on numpy arrays."""
    kept = np.ones(ids.size, dtype=bool)
    kept[replaced] = False
    kept_at = np.flatnonzero(kept)
    new_at = replaced[np.argsort(ids[replaced], kind="stable")]
    return np.insert(kept_at, np.searchsorted(ids[kept_at], ids[new_at]), new_at)


def torchrec_state(module: MCHManagedCollisionModule) -> dict[str, torch.Tensor]:
    """A live TorchRec ``module``'s whole remap state for :meth:`TableRemap.load_state_dict`: its
    state dict and what that leaves out (the history since its last eviction, when that was)."""
    state = dict(module.state_dict())
    if module._current_iter >= 0:
        state["_last_eviction_iter"] = torch.tensor([module._last_eviction_iter])
    if module._input_history_buffer_size >= 0:
        fill = module._current_history_buffer_offset
        state["_history_capacity"] = torch.tensor([module._input_history_buffer_size])
        state["_history"] = module._history_accumulator[:fill].clone()
        if "last_access_iter" in module._history_metadata:
            state["_history_last_access_iter"] = module._history_metadata["last_access_iter"][:fill].clone()
    return state
