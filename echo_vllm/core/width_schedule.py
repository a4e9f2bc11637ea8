"""When a tree-mode engine drafts siblings (the per-depth top-k) and when it drafts plain chains.

Drafting siblings costs a top-k per depth and the tree listing on every step that does it, whether the budget buys
any sibling or not. So once `patience` budget-decided tree steps in a row bought none, the engine drafts chains,
and looks again only around the depth plan's probes: the probe itself drafts trees (it verifies every node, which
keeps the siblings' acceptance statistics fresh) and the step after it drafts trees for the budget to decide on,
with those fresh statistics and the refitted costs. Without a depth plan (an integer k_max) a look comes every
`interval` steps instead.

The start-up profile drafts trees on every other depth block (`profile_index`) and chains on the rest, so that
the cost fit sees verifying steps with and without nodes off the spine. Why: with trees on every profile step,
"a step verifies something" and "a step verifies tree rows" were the same column, and the fit put the tree steps'
fixed cost (listing, fix-up, compaction) into the jump of verifying at all, which every chain step then paid: the
tree engine on the testbed priced a batch-4 chain step 1.5 ms (13 %) above its measured time (verify(B) 0.21 +
0.82 B ms against 0.02 + 0.07 B for the chain engine), every depth looked worse than plain decoding, and the plan
decoded plain on 153 of 374 steps where the chain engine drafted on all of them.

Looks back off while they buy nothing: after q looks in a row whose decision bought no sibling, only every
2^min(q, MAX_LOOK_BACKOFF)-th due look drafts trees (the others draft chains: a plain chain probe); a bought sibling
resets q. Why: a tree probe verifies the batch's best siblings and its next step drafts trees, and where width does
not pay that is pure cost: on the testbed at batch 8 (s27 profile job) a tree probe's step took ~32 ms against
~20 ms for a chain probe's and ~17 ms for other steps, once per 16 steps, about the tree engine's whole deficit to
the chain engine there (0.96x).

A probe never counts as bought width: it verifies every node by rule, not because width paid. (When it did count,
every probe restarted `patience` tree-drafting steps: on the CPU testbed at batch 1 about 60 % of the steps drafted
trees for one step in fifteen that bought a sibling.) Decisions depend on step counts and on what the budget
selected, which every TP rank has.
"""

from __future__ import annotations

from dataclasses import dataclass

from .time_budget import PROFILE_HOLD

WIDTH_PATIENCE = 8  # budget-decided tree steps in a row without a sibling bought, before chains
MAX_LOOK_BACKOFF = 3  # quiet looks in a row thin the looks out to every 2nd, 4th, at most 8th due one


@dataclass
class WidthSchedule:
    """State: budget-decided tree steps in a row that bought no sibling, whether the next step is a look, and the
    looks in a row that bought none (the back-off)."""

    patience: int = WIDTH_PATIENCE
    interval: int = 16  # steps between looks without a depth plan (probe_interval)
    max_backoff: int = MAX_LOOK_BACKOFF
    steps_without_width: int = 0
    look_next: bool = False
    clock: int = 0
    quiet_looks: int = 0  # looks in a row (outside patience) whose decision bought no sibling
    looks_due: int = 0  # looks due outside patience, taken or skipped (the back-off's clock)

    def drafts_trees(self, phase: str, probe_due: bool | None, profile_index: int | None = None) -> bool:
        """Whether this step drafts siblings. phase: the budget's phase ("warmup" selects spines only, the gates
        calibrate on them; "profile" must see tree steps and chain steps to price both); probe_due: the depth plan
        probes now (None: there is no depth plan, looks come from this schedule's own clock); profile_index: the
        profile step this one is (0-based; None: every profile step drafts trees). The profile holds each depth
        for PROFILE_HOLD steps in a cycle where every depth comes twice, at blocks of opposite parity
        (`profile_step`): trees on the even blocks and chains on the odd ones give each depth both shapes."""
        look, self.look_next = self.look_next, False
        if phase == "warmup":
            return False
        if phase == "profile":
            return profile_index is None or (profile_index // PROFILE_HOLD) % 2 == 0
        active = self.steps_without_width < self.patience
        if probe_due is None:
            self.clock += 1
            due = self.clock % max(1, self.interval) == 0
        else:
            due = bool(probe_due)
        if due and not active:
            self.looks_due += 1
            due = self.looks_due % (1 << min(self.quiet_looks, self.max_backoff)) == 0
        return active or due or look

    def after_plan(self, probe: bool) -> None:
        """This step's plan is known: after a probe that drafted trees, the next step looks (the budget decides on
        fresh data). The caller passes probe only for a tree-drafting probe."""
        self.look_next = self.look_next or probe

    def observe(self, bought_width: bool, probe: bool) -> None:
        """A tree-drafting step's selection: bought_width = some verified node is off the spine. Outside patience
        a budget-decided tree step is a look: one that buys nothing backs the looks off."""
        if probe:
            return
        if bought_width:
            self.steps_without_width = self.quiet_looks = 0
            return
        if self.steps_without_width >= self.patience:
            self.quiet_looks += 1
        self.steps_without_width += 1
