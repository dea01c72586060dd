"""The policy interface: given the Token Table's live rows (and, where needed, attention scores), return victims.

A policy is a small class: it names the per-token state it needs (``state_names``: one float per live entry, each
request's own, read and written through the rows), updates it from attention (``observe``) if it uses scores, and
ranks live entries by ``keep_score`` (higher = keep). What it needs of the engine it declares: when it is scored
(``needs_scores``, ``scored_at``; ``scoring``) and its own options (``options``: ``config`` serves each as
``--vtoken-<name>``). The shared driver ``select_victims`` does the rest, vectorized over requests:

- budget per request: ``budget`` tokens, or ``ceil(budget_ratio * logical_len)``, never below
  ``PolicyConfig.floor`` (sinks + recent, and at least sinks + 1: the newest token always stays);
- batching: a request is trimmed only when ``live > budget + slack``, and then down to ``budget``;
- protected entries: the first ``sinks`` logical tokens, the ``recent`` newest, and always the newest token (the
  engine writes the next token after it);
- victims: the ``live - budget`` unprotected entries with the lowest keep score (ties: older first).

Engine-agnostic and free of ``config`` (which derives its options from the policies, not the other way round).
"""

from __future__ import annotations

import abc
import dataclasses
import math
from collections.abc import Callable, Mapping
from typing import Any

import torch

from vtoken_sglang.core.token_table import TokenTable


@dataclasses.dataclass(frozen=True)
class PolicyOption:
    """An option a policy declares: served as ``--vtoken-<name>`` (``vtoken_<name>=``), read by the policy as
    ``self.cfg.options[name]``. ``parse``: raw value (CLI string or typed) to value, or ``ValueError`` with the
    reason; ``check``: the reason a parsed value is refused once the option is known to apply ('' if it is fine)."""

    name: str
    default: Any
    help: str
    parse: Callable[[Any], Any]
    check: Callable[[Any], str] | None = None


@dataclasses.dataclass(frozen=True)
class PolicyConfig:
    """What a policy reads of the options: the driver's (budget, sinks, recent, seed; their defaults are the
    options' defaults), ``slack``: the tokens a request may run over its budget before it is trimmed (batches
    evictions), and ``options``: policy options by name (``PolicyOption``; a policy's own left out take their
    declared defaults when it is made)."""

    budget: int | None = None
    budget_ratio: float | None = None
    sinks: int = 4
    recent: int = 64
    slack: int = 16
    seed: int = 0
    options: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        assert (self.budget is None) != (self.budget_ratio is None), "exactly one of budget, budget_ratio"

    @property
    def floor(self) -> int:
        """The fewest tokens a request is trimmed to: its sinks, its recent window, and at least its newest token."""
        return self.sinks + max(self.recent, 1)

    def with_defaults(self, declared: tuple[PolicyOption, ...]) -> PolicyConfig:
        """This config, with the ``declared`` options it does not give at their defaults."""
        missing = {o.name: o.default for o in declared if o.name not in self.options}
        return dataclasses.replace(self, options={**self.options, **missing}) if missing else self


@dataclasses.dataclass
class RowBlock:
    """The live rows of ``rows`` as a dense block ``[k, width]`` (``valid`` marks real entries)."""

    rows: torch.Tensor
    keys: torch.Tensor  # the table's stable per-request keys of ``rows``
    valid: torch.Tensor
    logical: torch.Tensor
    logical_len: torch.Tensor
    live_len: torch.Tensor
    state: dict[str, torch.Tensor]


def row_block(table: TokenTable, rows: torch.Tensor) -> RowBlock:
    width = max(int(table.live_len[rows].max()), 1)
    return RowBlock(
        rows,
        table.row_key[rows],
        table.valid(rows, width),
        table.row_logical(rows, width).to(torch.int64),
        table.logical_len[rows],
        table.live_len[rows],
        {name: table.row_state(name, rows, width) for name in table.state},
    )


SCORED_AT = ("decode", "prefill")


def scoring(cls: type[Policy]) -> str:
    """When the engine collects attention for ``cls``: ``"decode"``, ``"prefill"``, or ``""`` (never)."""
    return cls.scored_at if cls.needs_scores else ""


class Policy(abc.ABC):
    """Subclass it for a policy of your own (served with ``--vtoken-policy package.module:ClassName``): name the
    per-token state you keep (``state_names``: float32, one value per live entry, each request's own even for a
    shared prefix's tokens, moved with its token, 0 when the request starts reading it), fold attention into it in
    ``observe`` if ``needs_scores``, and rank in ``keep_score``."""

    name: str = ""
    needs_scores: bool = False
    # with needs_scores: what ``observe`` receives. "decode": every scored decode step, the newest query's
    # attention over the live tokens; "prefill": once per prompt, the attention of its last ``--vtoken-window``
    # queries.
    scored_at: str = "decode"
    state_names: tuple[str, ...] = ()
    options: tuple[PolicyOption, ...] = ()  # its own options (served as --vtoken-<name>; see PolicyOption)
    # Victims empty whole pages in order (a contiguous window), so eviction alone frees memory: Naive-Evict may
    # count on it at admission. Scattered victims leave pages trapped until something relocates them.
    frees_whole_pages: bool = False

    def __init__(self, cfg: PolicyConfig):
        self.cfg = cfg.with_defaults(self.options)

    @abc.abstractmethod
    def keep_score(self, block: RowBlock) -> torch.Tensor:
        """``[k, width]`` float scores; the lowest unprotected entries are evicted."""

    def observe(self, table: TokenTable, rows: torch.Tensor, attn: torch.Tensor, prefill: bool = False) -> None:
        """Fold one step of attention ``attn[k, width]`` (aligned with the live columns of ``rows``) into the
        state of the slots those columns hold (``table.add_row_state`` / ``set_row_state``). Score-free policies
        ignore it."""

    def budget(self, logical_len: torch.Tensor) -> torch.Tensor:
        """Tokens each request keeps, from its logical length; never decreasing as the logical length grows (the
        eviction round skips requests that cannot be over budget yet on that)."""
        c = self.cfg
        if c.budget is not None:
            b = torch.full_like(logical_len, c.budget)
        else:
            b = torch.ceil(logical_len.to(torch.float64) * c.budget_ratio).to(torch.int64)
        return torch.clamp(b, min=c.floor)

    def select_victims(
        self,
        table: TokenTable,
        rows: torch.Tensor,
        protect_cols: torch.Tensor | None = None,
        budget_at: torch.Tensor | None = None,
        newest: int | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Victims ``(rows, cols)`` of the requests in ``rows`` that exceed their budget plus slack.
        ``protect_cols[i]``: columns below it are kept too (an engine's shared prefix). ``budget_at[i]``: the
        logical length the budget is taken at (default: the row's own; a prompt evicted between its prefill chunks
        is held to the budget of its whole prompt). ``newest``: the newest logical positions kept (default:
        ``recent``; a prefill chunk's round keeps at least a sliding layer's window)."""
        empty = (rows.new_empty(0), rows.new_empty(0))
        if rows.numel() == 0:
            return empty
        budget = self.budget(table.logical_len[rows] if budget_at is None else budget_at)
        over = table.live_len[rows] > budget + self.cfg.slack
        rows, budget = rows[over], budget[over]
        if rows.numel() == 0:
            return empty
        floor = protect_cols[over] if protect_cols is not None else None
        block = row_block(table, rows)
        n_evict = block.live_len - budget
        protected = (
            ~block.valid
            | (block.logical < self.cfg.sinks)
            | (block.logical >= (block.logical_len - (self.cfg.recent if newest is None else newest))[:, None])
        )
        protected[torch.arange(len(rows)), block.live_len - 1] = True
        if floor is not None:
            protected |= torch.arange(protected.shape[1], device=rows.device)[None, :] < floor[:, None]
        score = self.keep_score(block).to(torch.float64).masked_fill(protected, math.inf)
        # lowest score first; among equals, the oldest (a stable sort keeps column order)
        order = torch.argsort(score, dim=1, stable=True)
        n_evict = torch.minimum(n_evict, (~protected).sum(1))  # a protected prefix can leave fewer candidates
        take = torch.arange(score.shape[1], device=rows.device)[None, :] < n_evict[:, None]
        r_i, rank = torch.nonzero(take, as_tuple=True)
        cols = order[r_i, rank]
        assert not bool(protected[r_i, cols].any())
        return rows[r_i], cols
