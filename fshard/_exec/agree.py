"""Outcomes of per-block functions that every process must share.

``map_local`` and ``shard_map`` run a user function on the blocks a process holds.
A process that holds no block of the arguments cannot know the result's dtype or
shape, and a function that raises on one process only would leave the others
waiting in the next collective. Where either can happen, every process runs
``agree``: it exchanges a description of what its function returned (or the error
it raised), so all processes learn the same metadata or all raise.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
from collections import Counter
from collections.abc import Callable, Generator, Iterable, Sequence
from typing import Any, TypeVar

import optree
import torch

from fshard._base.cache import cached
from fshard._base.calls import RECORD_ALIKE
from fshard._base.function import requires_grad_tells, transformed
from fshard._errors import CollectiveMismatchError, SpecError, as_error
from fshard._exec import gathered as _varying
from fshard._exec.readonly import read_only, versions
from fshard._layout.layout import Layout

__all__ = [
    "agree",
    "agree_alike",
    "closed_apart",
    "describe_results",
    "post_failure",
    "post_outcome",
    "tree_kinds",
    "holds_nothing_somewhere",
    "link_without_blocks",
    "merge_gradients",
    "merge_results",
    "on_every_rank",
    "untouched",
    "with_gradient",
]

Meta = tuple[torch.dtype, dict[Any, tuple[int, ...]]]

T = TypeVar("T")


def holds_nothing_somewhere(backend: Any, layout: Layout) -> bool:
    """Whether some process of a multi-process ``backend`` holds no shard of ``layout``.

    Every process computes the same answer from the layout alone, so it can decide
    whether all of them join an exchange.
    """
    return backend.spans_processes and len(layout.ranks) < backend.world_size


def agree(backend: Any, compute: Callable[[], T], describe: Callable[[T], Any]) -> tuple[T, list[Any]]:
    """``compute()`` here, and every process's ``describe`` of its result, in rank order.

    A collective on a multi-process ``backend``: if ``compute`` or ``describe`` raised
    on any process, every process raises, its own error where it had one, else that
    of the lowest rank that failed (with a note naming that rank). An interrupt there
    (``KeyboardInterrupt``, ``SystemExit``) is a ``CollectiveMismatchError`` here that
    names the rank; the interrupted process posts it, then goes on being interrupted.
    """
    result, seen, _ = _agree(backend, compute, describe, None)
    assert seen is not None  # always exchanged without ``alike``
    return result, seen


def agree_alike(
    backend: Any, compute: Callable[[], T], describe: Callable[[T], Any], alike: Callable[[Any], Any]
) -> tuple[T, list[Any] | None, Any]:
    """``agree``, with ``None`` for the descriptions where every process's is alike, and this process's own.

    ``alike`` gives a form of a description that names no rank (``None`` where there is
    none), from which the caller rebuilds every rank's description where all are alike.
    The processes first compare digests of those forms (one ``all_reduce`` of three
    numbers, ``backend.alike``): where every one is the same and nothing raised, the
    descriptions themselves are not exchanged. So a call costs the same on thousands of
    ranks as on two, unless the ranks' results differ; then they are exchanged as by
    ``agree``, which raises where they must.
    """
    return _agree(backend, compute, describe, alike)


def _agree(
    backend: Any, compute: Callable[[], T], describe: Callable[[T], Any], alike: Callable[[Any], Any] | None
) -> tuple[T, list[Any] | None, Any]:
    compare = getattr(backend, "alike", None) if alike is not None else None  # a backend may lack it: exchange
    try:
        result = compute()
        mine = ("ok", describe(result))
        form = alike(mine[1]) if compare is not None and alike is not None else None
    except BaseException as exc:  # an interrupt too: the others would wait for this rank's entry
        if compare is not None:
            compare(None)  # matches none: every rank goes on to the exchange, which carries the error
        backend.exchange(("error", exc))
        exc._fshard_posted = True  # type: ignore[attr-defined]  # the others know: check mode settles it
        raise
    if compare is not None and compare(None if form is None else _text_digest(repr(form))):
        return result, None, mine[1]
    seen = backend.exchange(mine)
    for rank, (kind, value) in zip(backend.ranks, seen):
        if kind == "error":
            error = as_error(value, rank, "function")
            error.add_note(f"(raised on rank {rank}; this rank's function returned)")
            raise error
    return result, [value for _, value in seen], mine[1]


def on_every_rank(backend: Any, ok: bool) -> bool:
    """Whether ``ok`` holds on every rank (a collective): one comparison of digests where the backend has it."""
    compare = getattr(backend, "alike", None)
    if compare is None:
        return all(backend.exchange(ok))
    return bool(compare(1 if ok else None))


def _text_digest(text: str) -> int:
    """A digest of ``text`` within ±2**62, alike on every process."""
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big") >> 2


def post_outcome(
    backend: Any,
    what: str,
    outcome: tuple[Any, Sequence[Meta]] | None,
    series: str = "",
    closed: int = 0,
    form: tuple[str, str] = ("", ""),
    recording: tuple[bool, ...] = (),
) -> None:
    """Posts what this process's function returned (its tree and each leaf's dtype), or that it raised (``None``).

    Where ``shard_map`` knows its results' layouts from the specs, no process waits for the
    others at the call; but a function that returned another structure, or raised, on one
    process only would leave the processes' next collectives paired wrongly. So each posts
    a digest of its outcome (``check_later``), and the group's next collective compares them:
    every process raises there where they differ, the one that raised too. ``series`` names
    the buckets in which the backward will sum the arguments' gradients (``buckets.agreed``):
    its digest rides in the same check, so their first launch needs no round of its own.
    ``closed`` counts the tensors from outside its arguments that the function used (each a
    sum over the ranks in the backward, which every rank must join). ``form``: what the
    caller's ranks must agree on, and this rank's text of it (``form_apart``). ``recording``:
    whether each result records a gradient here (``with_gradient``), which goes in the
    outcome's digest where some result does not.
    """

    def verdict(pairs: Sequence[tuple[int, bool, Any]]) -> Exception | None:
        failed = [r for r, f, _ in pairs if f]
        if len(failed) == len(pairs):  # every process raised its own error at the call
            return None
        if failed:
            return SpecError(
                f"{what} fn raised on rank(s) {failed}, whose error says why; the other ranks returned, and raise "
                "this at their next collective."
            )
        ranks = [r for r, _, _ in pairs]
        masks: list[int] | None = None  # last: a closure used on some ranks only makes them differ too
        # The caller's form, then the results' digest, the buckets' series, the count of closed-over tensors.
        for field in (3, 0, 1, 2):
            odd, like = _apart([d[field] for _, _, d in pairs], ranks)
            if odd:
                if field == 3:
                    return form_apart(what, form, f"ranks {odd} and ranks {like}")
                if field == 0 and all(d[0] ^ base < _RECORDING for _, _, d in pairs):  # alike but for recording
                    masks = [d[0] ^ base for _, _, d in pairs]  # each rank's mask of results recording none
                    continue
                return _apart_error(field, what, odd, like, (outcome, series, closed))
        if masks is None:
            return None
        flags = {r: [not (m >> k) & 1 for k in range(min(len(recording), _MASKED))] for r, m in zip(ranks, masks)}
        return recording_apart(what, flags)

    base = 0 if outcome is None else _digest_of(*outcome)
    digest = base ^ _not_recording(recording)
    backend.check_later(what, outcome is None, (digest, _text_digest(series), closed, _text_digest(form[1])), verdict)


_MASKED = 20  # the results whose recording the check of outcomes compares: the first 20
_RECORDING = 1 << _MASKED  # their masks stay below it


def _not_recording(recording: tuple[bool, ...]) -> int:
    """A mask of the first ``_MASKED`` results that record no gradient (result ``k`` at bit ``k``).

    Posted in the outcome's digest (XOR): ranks whose outcomes differ by less than ``_RECORDING``
    differ in this alone; every result recording (the usual step) leaves the digest as it is.
    Later results are compared where they move (the movements' headers).
    """
    mask = 0
    for k, r in enumerate(recording[:_MASKED]):
        if not r:
            mask |= 1 << k
    return mask


def recording_apart(what: str, recording: dict[int, list[bool]]) -> CollectiveMismatchError | None:
    """The error of ranks whose results differ in which record a gradient (``recording``: per rank, per result).

    ``None`` where they do not. The same text on every backend: ranks named, not this rank.
    """
    for k in range(min(min(map(len, recording.values()), default=0), _MASKED)):
        yes = [r for r, flags in sorted(recording.items()) if flags[k]]
        no = [r for r, flags in sorted(recording.items()) if not flags[k]]
        if yes and no:
            return CollectiveMismatchError(
                f"{what}: ranks {yes} return result {k} recording a gradient and ranks {no} return it without "
                f"one, so their backwards would differ: {RECORD_ALIKE}"
            )
    return None


def refuse_recording_apart(backend: Any, first: Layout, leaves: Sequence[dict[Any, torch.Tensor]], what: str) -> None:
    """In one process: ``recording_apart``'s error where ranks' results differ in which record a gradient.

    As processes find it in the check of outcomes they post (``post_outcome``), where every rank
    of the group holds blocks of the call's first argument (``first``): the group is ranks
    ``0 .. n-1`` of a ``LocalBackend(world_size=n)``, else ``first``'s ranks. ``leaves``: per
    result, its blocks by slot (placement, index).
    """
    world = getattr(backend, "world_size", 0)
    if not leaves or not recording_compared() or (world and len(first.ranks) < world):
        return
    recording: dict[int, list[bool]] = {}
    for k, leaf in enumerate(leaves):
        for (placement, _), t in leaf.items():
            flags = recording.setdefault(placement.rank, [False] * len(leaves))
            flags[k] = flags[k] or t.requires_grad
    refuse_recording(what, recording)


def recording_compared() -> bool:
    """Whether ranks compare which results of a call record a gradient: grad mode on, ``requires_grad`` telling it.

    Under ``no_grad`` a view of an argument that requires grad still does on some ranks (an
    empty block's ``contiguous()`` is itself) where others' copies do not (``requires_grad_tells``
    for the transforms).
    """
    return torch.is_grad_enabled() and requires_grad_tells()


def refuse_recording(what: str, recording: dict[int, list[bool]]) -> None:
    """Raises ``recording_apart``'s error where the ranks of ``recording`` differ (every rank holds blocks)."""
    error = recording_apart(what, recording)
    if error is not None:
        raise error


def form_apart(what: str, form: tuple[str, str], who: str) -> CollectiveMismatchError:
    """The error of ranks ``who`` whose callers' forms differ: ``form`` is (what they must agree on, this rank's)."""
    return CollectiveMismatchError(f"{what}: {who} differ in {form[0]} (this rank's: {form[1]}).")


def _apart_error(field: int, what: str, odd: list[int], like: list[int], mine: tuple[Any, str, int]) -> Exception:
    """The error of ranks ``odd`` whose posted outcome differs from ranks ``like``'s in ``field``.

    ``mine``: this rank's outcome, buckets' series and count of closed-over tensors.
    """
    outcome, series, closed = mine
    if field == 0:
        return SpecError(
            f"{what} fn returned another structure or other dtypes on ranks {odd} than on ranks {like} (this "
            f"rank's: {_shown(outcome)}); return one structure, with one dtype per result, on every placement."
        )
    if field == 1:
        return CollectiveMismatchError(
            f"{what}: ranks {odd} and ranks {like} would sum the gradients of its arguments in different "
            f"buckets (this rank's: {series or 'none'}): give every rank the same "
            "fshard.config(bucket_cap_mb=...) and the same arguments, and make the call inside "
            "fshard.no_sync() on every rank or on none."
        )
    return closed_apart(what, f"{closed} on this rank, other numbers on ranks {odd} than on ranks {like}")


def closed_apart(what: str, counts: str) -> SpecError:
    """The error of a call whose ``fn`` used different numbers of closed-over tensors on different ranks."""
    return SpecError(
        f"{what} fn used different numbers of tensors from outside its arguments that require grad (closed over) "
        f"on different ranks ({counts}): the backward sums each one's gradient over the ranks, which every rank "
        "must join. Pass such tensors as arguments (a replicated spec, e.g. fshard.Replicated(ranks)), or use "
        "them on every rank."
    )


def _apart(digests: Sequence[int], ranks: Sequence[int]) -> tuple[list[int], list[int]]:
    """The ranks whose digest is not the most common one, and those whose digest is."""
    usual = Counter(digests).most_common(1)[0][0]
    return [r for r, d in zip(ranks, digests) if d != usual], [r for r, d in zip(ranks, digests) if d == usual]


def post_failure(backend: Any, what: str, error: BaseException) -> None:
    """Posts that this process's function raised ``error`` (``post_outcome``); its own error goes first.

    Where the check ends at once (NCCL), every process has learned of the failure by then,
    the others raising the check's error: ``error`` is marked so, and check mode's round at
    the end of the call, which they skip, is skipped here too.
    """
    try:
        post_outcome(backend, what, None)
    except (SpecError, CollectiveMismatchError) as verdict:
        if getattr(verdict, "_fshard_agreed", False):
            error._fshard_agreed = True  # type: ignore[attr-defined]  # as the verdict every other rank raises


def _shown(outcome: tuple[Any, Sequence[Meta]] | None) -> str:
    if outcome is None:
        return "raised"
    tree, metas = outcome
    return f"{tree} of {[str(dtype) for dtype, _ in metas]}"


def _outcome_digest(tree: Any, dtypes: tuple[torch.dtype, ...]) -> int:
    """A digest of a result tree's structure (paths and node kinds) and its leaves' dtypes, alike on every process."""
    structure = None if tree is None else (optree.treespec_paths(tree), tree_kinds(tree))
    return _text_digest(repr((structure, [str(dtype) for dtype in dtypes])))


_cached_digest = cached(256)(_outcome_digest)  # one per kind of result


def _digest_of(tree: Any, metas: Sequence[Meta]) -> int:
    dtypes = tuple(dtype for dtype, _ in metas)
    try:
        return _cached_digest(tree, dtypes)
    except TypeError:  # a structure that cannot be hashed (a node's metadata): made afresh
        return _outcome_digest(tree, dtypes)


def tree_kinds(treedef: Any) -> tuple[Any, ...]:
    """A pytree structure's node types by qualified name, nested as the nodes are (``"leaf"`` for a leaf)."""
    kind = treedef.type
    name = "leaf" if kind is None else f"{kind.__module__}.{kind.__qualname__}"
    return (name, tuple(tree_kinds(child) for child in optree.treespec_children(treedef)))


@contextlib.contextmanager
def untouched(tensors: Sequence[torch.Tensor], what: str) -> Generator[None, None, None]:
    """Raises ``SpecError`` where the code in the block writes into any of ``tensors`` in place.

    An aten op that would write into one of them (or a view of one) is refused before it
    runs (``fshard._exec.readonly``), so the tensors keep their values. A write that this
    check cannot see (a kernel compiled by Inductor, code traced by TorchDynamo) still bumps
    the tensor's version counter, which its views share: that is read after the block, which
    then raises, the write done.
    """
    before = versions(tensors)
    with read_only(tensors, what):
        yield
    if versions(tensors) != before:
        msg = (
            f"{what} fn wrote into an input block in place (an in-place op such as t.mul_(10), or out=), "
            "in code that the check before each op does not see (compiled by Inductor, say), so the block "
            "holds the written values: ShardedArray values are immutable, and other arrays and tensors may "
            "share that memory. Return a new tensor instead (t * 10)."
        )
        raise SpecError(msg)


def describe_results(tree: Any, leaves: Sequence[dict[Any, torch.Tensor]]) -> tuple[Any, list[Meta]] | None:
    """What fn returned on this process, as plain data; ``None`` where it ran on nothing.

    That is its tree, and per leaf the dtype and the shape of the block at each key (a
    shard index or a slot).
    """
    if tree is None:
        return None
    return tree, [(next(iter(b.values())).dtype, {k: tuple(t.shape) for k, t in b.items()}) for b in leaves]


def merge_results(seen: Sequence[Any], what: str) -> tuple[Any, list[Meta]]:
    """One tree, and per leaf one dtype and every process's block shapes.

    Merged from the processes' ``describe_results`` (``(None, [])`` when fn ran nowhere).

    Raises:
        SpecError: fn returned different trees, or different dtypes for a leaf, on different ranks.
    """
    held = [d for d in seen if d is not None]
    if not held:
        return None, []
    tree = held[0][0]
    other = next((d[0] for d in held if d[0] != tree), None)
    if other is not None:
        raise SpecError(f"{what} fn returned {tree} on some ranks and {other} on others; return one structure.")
    metas: list[Meta] = []
    for n in range(tree.num_leaves):
        kinds = {d[1][n][0] for d in held}
        if len(kinds) > 1:
            raise SpecError(f"{what} result {n} has dtypes {sorted(map(str, kinds))} on different ranks; return one.")
        metas.append((kinds.pop(), {k: shape for d in held for k, shape in d[1][n][1].items()}))
    return tree, metas


def with_gradient(blocks: Iterable[torch.Tensor]) -> bool:
    """Whether fn returned a result's ``blocks`` here with a gradient (or may have: some ``torch.func`` transforms).

    Where no rank did, the link of a rank that ran fn on no block needs none either
    (``link_without_blocks``, detached). Under one ``torch.func.grad`` (or ``vjp``, ``jacrev``)
    ``requires_grad`` says it for that transform's level; under ``vmap``, forward mode or
    nested transforms a tensor does not say it (a batched ``p * x`` reads False where ``p``
    requires grad): there every link keeps its history.
    """
    return not requires_grad_tells() or any(t.requires_grad for t in blocks)


def link_without_blocks(arrays: Sequence[Any], dtype: torch.dtype, used: set[int], grad: bool = True) -> torch.Tensor:
    """A result's 0-element link where fn ran on no block.

    It joins every argument's link and the gathered tensors fn used on other ranks, so that
    backward reaches what it reaches there; detached where no rank's fn returned the result
    with a gradient (``grad`` False: ``t.detach()``, a comparison). Where some rank's fn returned
    it with a gradient that the arguments do not carry (a new leaf, ``t.detach().requires_grad_()``),
    the link is a new leaf too, so that ``requires_grad`` agrees on every rank.
    """
    link = _varying.join(functools.reduce(torch.add, (a._first() for a in arrays)).to(dtype), used)
    if not grad:
        return link.detach()
    if not link.requires_grad and not transformed():  # requires_grad says all there is to say
        return link.detach().requires_grad_()
    return link


def merge_gradients(flags: Sequence[tuple[bool, ...]], results: int) -> list[bool]:
    """Per result, whether some rank's fn returned it with a gradient, from every rank's ``with_gradient`` flags.

    A rank that ran fn on no block gives no flags.
    """
    return [any(f[n] for f in flags if f) for n in range(results)]
