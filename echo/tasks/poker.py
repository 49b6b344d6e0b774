"""`poker`: heads-up No-Limit Texas Hold'em, ECHO-2's multi-turn task (App. D), on pokerkit.

One prompt is one hand: its `seed` fixes the deal (a seeded shuffle, dealt explicitly: pokerkit
never shuffles), the policy's seat and the opponent; the `group_size` plays of a group are the
same hand played again, so the group's returns compare the policy's choices. Each policy turn
is one decision: the environment says the state as App. D lists it (hand, board, pot, to call,
stacks, legal actions) in one short line — every character is a token for the demo's byte-level
model — and the policy answers with one action:

    hand AsKd board Td8c2d pot 12 call 4 stack 34 opp 30 legal fold call 4 raise 8-34
    -> call | check | fold | raise | raise 12 | allin

Amounts are chips (blinds 1/2, stacks `stack_bb` big blinds); `raise N` raises *to* N, a bare
`raise` (or `bet`) makes a pot-sized raise (clamped to the legal range). An action
that does not parse or is not legal is **penalised**: the hand goes on as if the policy had
folded (or checked, where nothing is to be called) and the return loses `illegal_penalty_bb`.
The return is the policy's chip change in big blinds when the hand ends (0 for every step
before), penalties included.

Opponents (`opponents`, a mix the seed draws from; training against one made the others worse
in the paper): three rule-based styles acting on a hand-strength estimate — `station` (calls
everything, never raises), `tag` (tight-aggressive: folds weak hands, raises strong ones), `lag`
(loose-aggressive: raises often, bluffs on a seeded coin) — and `llm`, a frozen policy: any Hugging
Face model directory (`opponent_model`, e.g. the initial model) playing greedily from its own seat.
Everything is deterministic in the seed and the actions (the learner replays hands).

`hints = true` adds the hand-strength estimate the rule-based opponents use to the state
(`str 0.62`): a demo aid for a tiny model that cannot learn card evaluation in minutes on a
CPU. Off by default; the demo's README table says when it was on.
"""

from __future__ import annotations

import functools
import random
import re
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Literal

from pydantic import Field

from echo.tasks.base import Environment, Message, Prompt, Step, Task, TaskError, TaskOptions, register_task

warnings.filterwarnings("ignore", module="pokerkit")  # it warns on every legal-but-odd action; the table decides

RANKS = "23456789TJQKA"
SUITS = "cdhs"
DECK = [r + s for r in RANKS for s in SUITS]
STYLES = ("station", "tag", "lag", "llm")
SB, BB = 1, 2
_ACTION = re.compile(r"^\s*(fold|check|call|allin|all-in|(?:raise|bet)(?:\s+(\d{1,6}))?)\s*$")
_CATEGORY = {"High card": 0, "One pair": 1, "Two pair": 2, "Three of a kind": 3, "Straight": 4, "Flush": 5,
             "Full house": 6, "Four of a kind": 7, "Straight flush": 8}


class PokerOptions(TaskOptions):
    stack_bb: int = Field(20, ge=2, le=500, description="task.stack_bb: starting stacks in big blinds (blinds 1/2 chips)")
    opponents: list[Literal["station", "tag", "lag", "llm"]] = Field(
        ["station", "tag", "lag"], min_length=1, description="task.opponents: the mix each hand draws its opponent from")
    opponent_model: str = Field("", description="task.opponent_model: HF model directory of the 'llm' opponent (greedy)")
    hints: bool = Field(False, description="task.hints: add the hand-strength estimate to the state (a demo aid)")
    illegal_penalty_bb: float = Field(1.0, ge=0.0, le=100.0, description="task.illegal_penalty_bb: what an unparseable or illegal action costs")
    turns: int = Field(8, ge=1, le=64, description="task.turns: most policy decisions in one hand")
    eval_size: int = Field(200, ge=2, le=100_000, description="task.eval_size: eval hands (duplicate: each deal from both seats)")
    eval_seed: int = Field(777, ge=0, description="task.eval_seed: seed of the fixed eval set")


# --- hand strength ----------------------------------------------------------------------------------

def preflop_strength(hole: list[str]) -> float:
    """A Chen-style score of two hole cards in [0, 1]: pairs and high, suited, connected cards."""
    a, b = sorted((RANKS.index(c[0]) for c in hole), reverse=True)
    score = (a + 2) / 14 * 0.55
    if a == b:
        score = 0.5 + a / 12 * 0.5
    else:
        score += (b + 2) / 14 * 0.2 + (0.08 if hole[0][1] == hole[1][1] else 0) + max(0, 0.08 - 0.02 * (a - b - 1))
    return round(min(1.0, score), 2)


@functools.lru_cache(maxsize=65536)
def _made_hand(hole: tuple[str, ...], board: tuple[str, ...]) -> float:
    from pokerkit import StandardHighHand

    hand = StandardHighHand.from_game("".join(hole), "".join(board))
    category = _CATEGORY.get(hand.entry.label.value if hasattr(hand.entry.label, "value") else str(hand.entry.label), 0)
    top = max(RANKS.index(c[0]) for c in hole)
    return round(min(1.0, 0.18 + category * 0.16 + top / 12 * 0.1), 2)


def strength(hole: list[str], board: list[str]) -> float:
    """What the rule-based opponents (and the hints) act on: preflop the hole cards' score, after
    the flop the made hand's category (a pair of the board counts as little as it is worth)."""
    if not board:
        return preflop_strength(hole)
    return _made_hand(tuple(hole), tuple(board))


# --- the opponents ---------------------------------------------------------------------------------

def pot_raise(call: int, pot: int, lo: int | None, hi: int | None) -> int | None:
    """The raise-to amount of a pot-sized raise, within the legal range (None: no raise is legal)."""
    return None if lo is None else min(hi, max(lo, call + pot))


def rule_action(style: str, s: float, call: int, pot: int, lo: int | None, hi: int | None, coin: float) -> str:
    """A rule-based decision: `s` strength, `call` chips to call, raise-to range [lo, hi] (None: no raise)."""
    raise_to = pot_raise(call, pot, lo, hi)
    if style == "station":
        return "call" if call else "check"
    if style == "tag":
        if s >= 0.62 and raise_to is not None:
            return f"raise {raise_to}"
        if s >= 0.42 or (call and call <= pot // 4 and s >= 0.3):
            return "call" if call else "check"
        return "fold" if call else "check"
    # lag: raises wide, bluffs on the coin, calls down light
    if raise_to is not None and (s >= 0.45 or coin < 0.3):
        return f"raise {raise_to}"
    if s >= 0.25 or not call or coin < 0.5:
        return "call" if call else "check"
    return "fold"


def _opponent_here(model_dir: str) -> None:
    if not (Path(model_dir) / "config.json").is_file():  # not a name on a hub: nothing is downloaded at run time
        raise TaskError(f"task.opponent_model: {model_dir!r} is not a Hugging Face model directory on this machine "
                        f"(from {Path.cwd()}). Build the demo's with `echo-rl build-model --config configs/poker.toml`, "
                        "or point task.opponent_model at the frozen opponent's model directory")


@functools.cache
def _llm(model_dir: str):
    """A frozen HF policy on the CPU in fp32, loaded once per process."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from echo.chat import Chat, stop_ids

    _opponent_here(model_dir)
    tok = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, local_files_only=True).eval()
    return model, tok, Chat(tok, "auto", stop_ids=stop_ids(tok, model_dir))


def llm_action(model_dir: str, state_line: str) -> str:
    """The frozen policy's greedy action for one state line (no history: what it would say first)."""
    import torch

    from echo.hf import sample

    model, tok, chat = _llm(model_dir)
    with torch.no_grad():
        out = sample(model, [chat.first([{"role": "user", "content": state_line}])], max_new_tokens=12,
                     stop_ids=sorted(chat.stop_ids), pad_id=tok.pad_token_id or 0, temperature=0.0)
    return tok.decode(out[0].tokens, skip_special_tokens=True)


# --- the table ---------------------------------------------------------------------------------------

class HoldemEnv(Environment):
    """One hand against one opponent; the policy sits at `seat` (pokerkit's index 1 is the button)."""

    def __init__(self, options: PokerOptions, seat: int | None = None, opponent: str | None = None):
        self.o, self.fixed_seat, self.fixed_opponent = options, seat, opponent

    # pokerkit state and the seeded deal
    def reset(self, seed: int) -> list[Message]:
        from pokerkit import Automation, Mode, NoLimitTexasHoldem

        rng = random.Random(f"poker-{seed}")
        deck = DECK[:]
        rng.shuffle(deck)
        self.seat = self.fixed_seat if self.fixed_seat is not None else rng.randrange(2)
        mix = self.o.opponents
        self.opponent = self.fixed_opponent or mix[rng.randrange(len(mix))]
        self.coins = random.Random(f"poker-opponent-{seed}")
        self.stack = self.o.stack_bb * BB
        automations = (Automation.ANTE_POSTING, Automation.BET_COLLECTION, Automation.BLIND_OR_STRADDLE_POSTING,
                       Automation.CARD_BURNING, Automation.HOLE_CARDS_SHOWING_OR_MUCKING, Automation.HAND_KILLING,
                       Automation.CHIPS_PUSHING, Automation.CHIPS_PULLING)
        self.state = NoLimitTexasHoldem.create_state(automations, True, 0, (SB, BB), BB, (self.stack, self.stack), 2,
                                                     mode=Mode.TOURNAMENT)  # one runout after all-in, no choice to make
        self.holes = [[deck.pop(), deck.pop()] for _ in range(2)]
        self.board_deck = deck[:5]
        for _ in range(2):
            p = self.state.hole_dealee_index
            self.state.deal_hole("".join(self.holes[p]))
        self.penalty, self.last = 0.0, ""
        self._advance()
        return [{"role": "user", "content": self.describe()}]

    @property
    def board(self) -> list[str]:
        return self.board_deck[: sum(len(c) for c in self.state.board_cards)]

    def legal(self) -> tuple[int, int | None, int | None]:
        """(chips to call, min raise-to, max raise-to) for the player to act."""
        st = self.state
        call = st.checking_or_calling_amount or 0
        if st.can_complete_bet_or_raise_to():
            return call, st.min_completion_betting_or_raising_to_amount, st.max_completion_betting_or_raising_to_amount
        return call, None, None

    def describe(self, seat: int | None = None) -> str:
        """The state line for `seat` (default: the policy's)."""
        p = self.seat if seat is None else seat
        st = self.state
        call, lo, hi = self.legal()
        pot = sum(st.pot_amounts) + sum(st.bets)
        legal = (["fold", f"call {call}"] if call else ["check"]) + ([f"raise {lo}-{hi}"] if lo is not None else [])
        if not st.status:
            return f"opp {self.last}; hand over"
        parts = [f"hand {''.join(self.holes[p])}", f"board {''.join(self.board) or '-'}", f"pot {pot}",
                 f"call {call}", f"stack {st.stacks[p]}", f"opp {st.stacks[1 - p]}"]
        if self.o.hints:
            parts.append(f"str {strength(self.holes[p], self.board):.2f}")
        if self.last and seat is None:
            parts.insert(0, f"opp {self.last};")
        return " ".join(parts + ["legal " + " ".join(legal)])

    def _apply(self, action: str) -> bool:
        """Apply `action` for the player to act; False (and nothing done) when it is not legal."""
        st = self.state
        call, lo, hi = self.legal()
        m = _ACTION.match(action.lower())
        if not m:
            return False
        word = m.group(1)
        if word == "fold" and call:
            st.fold()
        elif word in ("check", "call") and (word == "call") == bool(call):
            st.check_or_call()
        elif word in ("allin", "all-in"):
            if hi is not None:
                st.complete_bet_or_raise_to(hi)
            elif call:
                st.check_or_call()  # all-in by calling what is left
            else:
                return False
        elif word.startswith(("raise", "bet")) and lo is not None:
            amount = int(m.group(2)) if m.group(2) is not None else pot_raise(call, sum(st.pot_amounts) + sum(st.bets), lo, hi)
            if not lo <= amount <= hi:
                return False
            st.complete_bet_or_raise_to(amount)
        else:
            return False
        return True

    def _advance(self) -> None:
        """Deal streets and let the opponent act until the policy is to act or the hand is over."""
        st = self.state
        while st.status:
            if st.can_deal_board():
                count = 3 if not st.board_cards else 1
                st.deal_board("".join(self.board_deck[len(self.board): len(self.board) + count]))
            elif st.actor_index == self.seat:
                return
            elif st.actor_index is not None:
                action = self._opponent_action()
                if not self._apply(action):  # an opponent's illegal action: the passive one instead
                    action = "call" if self.legal()[0] else "check"
                    self._apply(action)
                self.last = action
            else:
                raise RuntimeError(f"pokerkit is waiting for an operation this table does not make: {st.operations[-1:]}")

    def _opponent_action(self) -> str:
        p = 1 - self.seat
        if self.opponent == "llm":
            if not self.o.opponent_model:
                return "call" if self.legal()[0] else "check"
            return llm_action(self.o.opponent_model, self.describe(seat=p))
        call, lo, hi = self.legal()
        pot = sum(self.state.pot_amounts) + sum(self.state.bets)
        return rule_action(self.opponent, strength(self.holes[p], self.board), call, pot, lo, hi, self.coins.random())

    def step(self, action: str) -> Step:
        if not self.state.status:  # the opponent folded before the policy's first decision: nothing to decide
            return Step([], self.result(), True)
        if not self._apply(action):
            self.penalty += self.o.illegal_penalty_bb
            self._apply("fold" if self.legal()[0] else "check")
        self.last = ""
        self._advance()
        if not self.state.status:
            return Step([], self.result(), True)
        return Step([{"role": "user", "content": self.describe()}])

    def result(self) -> float:
        """The policy's chip change in big blinds, penalties included."""
        return (self.state.stacks[self.seat] - self.stack) / BB - self.penalty

    def expert_action(self) -> str:
        """A reasonable decision for the policy's seat (the warm start's demonstrations): a
        tight-aggressive player that value-raises strong hands and folds weak ones to bets."""
        call, lo, hi = self.legal()
        pot = sum(self.state.pot_amounts) + sum(self.state.bets)
        action = rule_action("tag", strength(self.holes[self.seat], self.board), call, pot, lo, hi, 1.0)
        return "raise" if action.startswith("raise") else action  # the pot-sized raise, in one word


@register_task
class PokerTask(Task):
    """Heads-up No-Limit Hold'em against a mix of opponents; the return in big blinds."""

    name = "poker"
    Options = PokerOptions
    options: PokerOptions

    def __init__(self, options: PokerOptions | None = None):
        super().__init__(options)
        self.max_turns = self.options.turns
        if "llm" in self.options.opponents and not self.options.opponent_model:
            raise TaskError("task.opponents includes 'llm' but task.opponent_model is empty: give a Hugging Face "
                            "model directory for the frozen opponent (e.g. the initial model)")

    def check_here(self) -> None:
        if "llm" in self.options.opponents:
            _opponent_here(self.options.opponent_model)

    def model_dirs(self) -> dict[str, str]:
        return {"opponent_model": self.options.opponent_model} if "llm" in self.options.opponents else {}

    def train_prompts(self, seed: int) -> Iterator[Prompt]:
        rng = random.Random(f"poker-train-{seed}")
        i = 0
        while True:
            hand = rng.randrange(1 << 40)
            yield Prompt(id=f"poker-{seed}-{i}", text="", answer="", seed=hand)
            i += 1

    def eval_prompts(self) -> list[Prompt]:
        """Duplicate deals: hands 2k and 2k+1 share the cards, the policy in either seat."""
        rng = random.Random(f"poker-eval-{self.options.eval_seed}")
        out = []
        for k in range(self.options.eval_size // 2):
            deal = rng.randrange(1 << 39)
            out += [Prompt(id=f"poker-eval-{k}-{seat}", text="", answer="", seed=2 * deal + seat) for seat in (0, 1)]
        return out

    def environment(self, prompt: Prompt) -> Environment:
        if prompt.id.startswith("poker-eval-"):  # duplicate: the seat from the seed's parity, the same deal
            return _DuplicateSeat(self.options)
        return HoldemEnv(self.options)


class _DuplicateSeat(HoldemEnv):
    """An eval hand: the deal from `seed // 2` (both seats share it), the seat from `seed % 2`."""

    def reset(self, seed: int) -> list[Message]:
        self.fixed_seat = seed % 2
        return super().reset(seed // 2)
