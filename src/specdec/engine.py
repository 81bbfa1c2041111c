"""The one loop: propose -> score -> verify -> commit, for a batch of sequences.

Sequences join (`add`) and leave (finished) at step boundaries, each with its
own sampling parameters, seed, stop conditions and metrics. Every sequence
accepts its own number of drafts; nothing assumes batch size 1.

Random numbers are keyed by position (`sampling.position_uniforms`): the token a
sequence gets at position t is decided by u(seed, t, TARGET) whichever step scores
it, so with point-mass drafts the output is the one plain sampling gives, token for
token, whatever the draft length, the policy or the batch (see verify.py).

Prompts are prefilled in pieces aligned to PREFILL_PIECE tokens, at most
`prefill_budget` tokens per step; while sequences are decoding, prefill steps
and decode steps alternate, so a long prompt or a burst of new ones never stalls
the others for more than one bounded step. Full pieces go to the prefix cache.
"""
from __future__ import annotations

import heapq
import time
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import Tensor

from .draft_length import DraftPolicy
from .errors import SpecdecError, is_allocation_failure, requested_size
from .logprobs import TokenLogprob, token_logprobs
from .metrics import Counters
from .models.base import CausalLM
from .prefix_cache import PREFILL_PIECE, Piece, PrefixCache, piece_keys
from .predictions import PREDICTION_DRAFT_TOKENS, Predictions, with_predictions
from .proposers.base import ActiveBatch, Proposer
from .sampling import BatchSampling, SamplingParams, Stream, position_uniforms, sample, seed_tensor, to_probs
from .text_output import TextOutput
from .tree import MAX_TREE_BUDGET
from .verify import Draft, Verdict, check_draft, follow, verify, verify_tree


PROMPT_HEAD_ROWS = 64        # prompt rows scored per LM-head call where a request asks for its prompt's logprobs


def scratch_slots(num_draft_tokens: int) -> int:
    """Cache slots a sequence needs past its last token for a step's drafts: the pending token and twice
    the asked K (the `heuristic` and `auto` policies draft more than it), a prediction's drafts, or the
    largest token tree. A step never drafts more than the room left (Engine._propose cuts it)."""
    return 1 + max(2 * num_draft_tokens, PREDICTION_DRAFT_TOKENS, MAX_TREE_BUDGET)


@dataclass
class Request:
    prompt: list[int]
    max_new_tokens: int
    sampling: SamplingParams = SamplingParams()
    stop: tuple[str, ...] = ()
    speculate: bool = True            # False: this sequence gets no drafts (plain decoding inside a speculative batch)
    prediction: tuple[int, ...] = ()  # the output the client expects (token ids), a draft source for any method
    tenant: str = ""                  # who may learn from whose outputs (suffix decoding's index); "": one shared
    logprobs: bool = False            # record each generated token's log-probability (logprobs.py)
    top_logprobs: int = 0             # ... and that many most likely alternatives at its position
    prompt_logprobs: bool = False     # record the prompt's tokens' too (from its second token on)


@dataclass(eq=False)
class SequenceState:
    """A request being decoded: its row in the caches, output so far, metrics (compared by identity)."""
    request: Request
    row: int
    output: TextOutput                                       # detokenizes new tokens, finds stop strings
    tokens: list[int] = field(default_factory=list)        # prompt + generated
    text: str = ""                                           # text emitted so far (stop strings cut)
    read: int = 0                                            # tokens[:read] given to `output` or the prompt
    finish_reason: str = ""                                  # "", "stop" or "length"
    counters: Counters = field(default_factory=Counters)
    started: float = 0.0
    prefilled: int = 0                                       # prompt tokens in the target's cache
    cached: int = 0                                          # of them copied from the prefix cache
    logprobs: list[TokenLogprob] = field(default_factory=list)  # one per generated token, if the request asks
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)  # one per prompt token after the first, if asked

    @property
    def generated(self) -> list[int]:
        return self.tokens[len(self.request.prompt):]

    @property
    def num_generated(self) -> int:
        return len(self.tokens) - len(self.request.prompt)

    @property
    def done(self) -> bool:
        return bool(self.finish_reason)


@dataclass(frozen=True)
class Scored:
    """The target's forward over a step's drafts: the pending token (row 0), then the draft nodes."""
    hidden: Tensor                    # [B, N, H] the target's features of the scored rows
    logits: Tensor                    # [B, N, V] float32: what each row gives its next position
    positions: Tensor                 # [B, N] each row's position
    greedy: bool                      # the step verifies a chain of point masses greedily (`Engine._greedy`)
    top: Tensor                       # [B, N] int64 each row's argmax where greedy (from the head's call), else [B, 0]


class Engine:
    def __init__(self, target: CausalLM, proposer: Proposer, policy: DraftPolicy,
                 decode: Callable[[list[int]], str], eos_ids: frozenset[int],
                 prefix_cache: PrefixCache | None = None, prefill_budget: int = 512,
                 byte_ids: frozenset[int] = frozenset()) -> None:
        """prefix_cache: shared by the engines of one target (capacity 0: off; not given: a disabled one of
        this engine's own); prefill_budget: prompt tokens prefilled per step (at least one piece); byte_ids:
        the tokenizer's byte-fallback tokens (their text waits for the end of their run, detokenize.py)."""
        if prefill_budget < 1:
            raise ValueError("prefill_budget must be >= 1 token")
        self.target, self.proposer, self.policy = target, proposer, policy
        self.features = proposer.feature_layers                               # what the target's forwards return
        self.predictions = Predictions()                                       # requests' predicted outputs draft too
        self.decode, self.eos_ids, self.byte_ids = decode, eos_ids, byte_ids
        self.prefix_cache = prefix_cache if prefix_cache is not None else PrefixCache(0)
        self.prefill_budget = prefill_budget
        self.active: list[SequenceState] = []
        self.pending: list[SequenceState] = []
        self.prompt_hidden: dict[int, list[Tensor]] = {}                     # row -> hidden [T, H] per piece
        self.prefilled_last = False                                            # the last step prefilled
        self.rows = 0
        self.slots = 0
        self._last_batch: tuple[list[SequenceState], ActiveBatch] = ([], self._new_batch([]))

    # ---- capacity -----------------------------------------------------------------
    def allocate(self, rows: int, slots: int) -> None:
        """Caches for `rows` concurrent sequences of up to `slots` tokens (+ draft scratch)."""
        self.rows, self.slots = rows, slots
        try:
            self.cache = self.target.new_cache(rows, slots)
            self.proposer.allocate(rows, slots)
        except (RuntimeError, MemoryError) as e:
            if not is_allocation_failure(e):
                raise
            raise SpecdecError(f"not enough memory for the caches of {rows} sequence(s) of up to {slots} tokens"
                               f"{requested_size(e)}: the caches hold room for the prompt plus max_new_tokens of every "
                               "sequence; ask for fewer new tokens or fewer prompts at once") from None
        self.predictions.reset()
        self.free = list(range(rows))                                          # a heap: lowest free row first
        self.active, self.pending = [], []
        self.prompt_hidden = {}

    def add(self, request: Request) -> SequenceState:
        """Queue a request; it is prefilled at the next step boundary."""
        if not self.free:
            raise SpecdecError("no free slot: the batch is full")
        need = len(request.prompt) + request.max_new_tokens + 1
        if need > self.slots:
            raise SpecdecError(f"prompt ({len(request.prompt)} tokens) + max_new_tokens ({request.max_new_tokens}) "
                               f"must be below the context of {self.slots} tokens (one slot stays spare)")
        # the lowest free row: active rows stay one contiguous block of the cache as long as they can, so
        # the decoder reads their keys in place instead of gathering them (see KVCache.read)
        row = heapq.heappop(self.free)
        text = TextOutput(self.decode, request.stop, self.byte_ids, request.prompt)         # decoded after the prompt
        seq = SequenceState(request, row, text, list(request.prompt), read=len(request.prompt),
                            started=time.perf_counter())
        rows = torch.tensor([row], device=self.target.device)
        self.cache.truncate(rows, torch.zeros_like(rows))
        self.prompt_hidden[row] = []
        for piece in self.prefix_cache.lookup(request.prompt, self.features):  # exactly the bits a prefill makes
            self.cache.append(row, piece.k, piece.v)
            self.prompt_hidden[row].append(piece.hidden)
            seq.prefilled += PREFILL_PIECE
        seq.cached = seq.prefilled
        self.pending.append(seq)
        return seq

    def cancel(self, seq: SequenceState) -> None:
        """Stop a sequence (client gone): frees its slot at once."""
        if seq in self.pending:
            self.pending.remove(seq)
            self.prompt_hidden.pop(seq.row, None)
        if seq in self.active:
            self.active.remove(seq)
        if not seq.done:
            seq.finish_reason = "cancelled"
            heapq.heappush(self.free, seq.row)

    @property
    def busy(self) -> bool:
        return bool(self.active or self.pending)

    @property
    def prefills_next(self) -> bool:
        """Whether the next step prefills (new prompts wait, and nothing decodes or the last step decoded)."""
        return bool(self.pending) and (not self.active or not self.prefilled_last)

    # ---- one step -----------------------------------------------------------------
    def step(self) -> list[tuple[SequenceState, str]]:
        """Prefill newcomers, or run one speculative step for the active batch.

        Returns (sequence, newly emitted text) for every sequence that emitted text or finished.
        """
        if self.prefills_next:
            ready = self._prefill_pieces()
            if ready:
                self._start(ready)
                self.active.extend(ready)
                self.active.sort(key=lambda s: s.row)                          # rows in order: contiguous if dense
            self.prefilled_last = True
        elif self.active:
            k = self.policy.choose(len(self.active), max(s.request.max_new_tokens - s.num_generated
                                                         for s in self.active))
            for group in self._room_groups(self.active, k):
                self._speculate(group, k)
            self.prefilled_last = False
        else:
            return []
        events = []
        for seq in self.active:
            piece = self._emit(seq)
            if piece or seq.done:
                events.append((seq, piece))
            if seq.done:
                heapq.heappush(self.free, seq.row)
                seq.counters.wall_seconds = time.perf_counter() - seq.started
        self.active = [s for s in self.active if not s.done]                   # one pass: batches may be huge
        return events

    def _batch(self, seqs: list[SequenceState]) -> ActiveBatch:
        """The proposer's view of `seqs`; the last one again while the same sequences decode (their token
        lists grow in place), as building it takes a handful of tensors."""
        if self._last_batch[0] == seqs:
            return self._last_batch[1]
        batch = self._new_batch(seqs)
        self._last_batch = (list(seqs), batch)
        return batch

    def _new_batch(self, seqs: list[SequenceState]) -> ActiveBatch:
        dev = self.target.device
        return ActiveBatch(torch.tensor([s.row for s in seqs], device=dev), [s.tokens for s in seqs],
                           BatchSampling.of([s.request.sampling for s in seqs], dev),
                           seed_tensor([s.request.sampling.seed for s in seqs], dev), [s.request.tenant for s in seqs])

    def _prefill_pieces(self) -> list[SequenceState]:
        """Prefill up to prefill_budget prompt tokens (at least one piece), in rounds of one piece per
        waiting prompt; returns the sequences whose prompts are now complete (no longer pending).

        A piece runs from a prompt's prefilled length to the next multiple of PREFILL_PIECE (or its end),
        so every prompt is cut the same way whoever else is waiting and whatever the prefix cache held:
        a position's bits depend only on its prompt. Pieces of equal length up to the target's
        batch_prefill_limit share a forward (batch-invariant kernels there); others get one each."""
        t0 = time.perf_counter()
        dev = self.target.device
        budget, touched = self.prefill_budget, {}                                # row -> sequence
        while budget > 0:
            work = []                                                          # (seq, start, end)
            for s in self.pending:
                a = s.prefilled
                if a < len(s.request.prompt) and budget > 0:
                    b = min(len(s.request.prompt), (a // PREFILL_PIECE + 1) * PREFILL_PIECE)
                    work.append((s, a, b))
                    budget -= b - a
            if not work:
                break
            groups: dict[int, list[int]] = {}
            for i, (s, a, b) in enumerate(work):
                n = b - a
                groups.setdefault(n if n <= self.target.batch_prefill_limit else -1 - i, []).append(i)
            for idx in groups.values():
                inp = torch.tensor([work[i][0].request.prompt[work[i][1]:work[i][2]] for i in idx], device=dev)  # [G, T]
                starts = torch.tensor([work[i][1] for i in idx], device=dev)
                pos = starts[:, None] + torch.arange(inp.shape[1], device=dev)  # [G, T]
                rows = torch.tensor([work[i][0].row for i in idx], device=dev)
                hidden = self.target.prefill(inp, pos, self.cache, rows, self.features)   # [G, T, H']
                self.cache.commit(rows, torch.arange(inp.shape[1], device=dev).expand_as(inp),
                                  torch.full_like(rows, inp.shape[1]))
                for j, i in enumerate(idx):
                    s, a, b = work[i]
                    s.prefilled = b
                    self.prompt_hidden[s.row].append(hidden[j])
                    if b - a == PREFILL_PIECE and self.prefix_cache.enabled:
                        k, v = self.cache.span(s.row, a, b)
                        self.prefix_cache.store(piece_keys(s.request.prompt[:b], self.features)[-1],
                                                Piece(k, v, hidden[j].clone()))
            touched.update((s.row, s) for s, _, _ in work)
        dt = time.perf_counter() - t0
        for s in touched.values():
            s.counters.target_seconds += dt
        ready = [s for s in self.pending if s.prefilled == len(s.request.prompt)]
        if ready:
            self.pending = [s for s in self.pending if s.prefilled < len(s.request.prompt)]
        return ready

    def _start(self, seqs: list[SequenceState]) -> None:
        """Sample each complete prompt's first token and start the proposer on it."""
        t0 = time.perf_counter()
        batch = self._batch(seqs)
        dev = self.target.device
        lens = torch.tensor([len(s.tokens) for s in seqs], device=dev)
        hidden = torch.nn.utils.rnn.pad_sequence([torch.cat(self.prompt_hidden.pop(s.row)) for s in seqs],
                                                 batch_first=True)            # [B, P, H]
        last = hidden[torch.arange(len(seqs), device=dev), lens - 1]           # [B, H]
        for i, s in enumerate(seqs):
            if s.request.prompt_logprobs:
                s.prompt_logprobs = self._scored_prompt(hidden[i, :len(s.tokens) - 1], s.tokens[1:],
                                                        s.request.top_logprobs)
        logits = self.target.lm_head(last)[:, None]                            # [B, 1, V]
        p = to_probs(logits, batch.sampling)                                   # [B, 1, V]
        u = position_uniforms(batch.seeds, lens[:, None], Stream.TARGET)       # [B, 1] the first token's position
        first = sample(p[:, 0], u[:, 0])                                       # [B]
        for i, s in enumerate(seqs):
            s.tokens.append(int(first[i]))
        self._note_logprobs(seqs, logits, torch.zeros_like(logits[:, :, 0], dtype=torch.long), [1] * len(seqs))
        self.predictions.start([s.row for s in seqs], [s.request.prediction for s in seqs],
                               [s.generated for s in seqs])
        self.proposer.start(batch.rows, [list(s.tokens) for s in seqs], hidden)
        dt = time.perf_counter() - t0
        for s in seqs:
            s.counters.record_step(0, 0, 1)
            s.counters.target_seconds += dt
            self._check_end(s, len(s.tokens) - 1)

    def _room_groups(self, seqs: list[SequenceState], k: int) -> list[list[SequenceState]]:
        """The batch, or, where some rows lack the cache room for k drafts (near the end of the model's context),
        the others and then each of those alone: a step drafts at most what its fullest row has room for, so a
        row's drafts (and, where they are sampled, its tokens for a seed) never depend on a batch-mate's room.
        Such a row's own remaining tokens always fit its room, so alone it drafts all it can use."""
        tight = [s for s in seqs if self._room(s) < k]
        if not tight or len(seqs) == 1:
            return [seqs]
        roomy = [s for s in seqs if self._room(s) >= k]
        return ([roomy] if roomy else []) + [[s] for s in tight]

    def _room(self, s: SequenceState) -> int:
        """Cache slots `s` has for drafts: its scratch past the pending token."""
        return self.slots - len(s.tokens) - 1

    def _speculate(self, seqs: list[SequenceState], k: int) -> None:
        """One step of the active batch: propose (at most k drafts) -> score -> verify -> commit."""
        batch = self._batch(seqs)
        pending = torch.tensor([s.tokens[-1] for s in seqs], device=self.target.device)   # [B] not yet scored
        k = max(0, min(k, min(self._room(s) for s in seqs)))                     # what the proposer is asked for
        t0 = time.perf_counter()
        draft = self._propose(seqs, batch, k)
        t1 = time.perf_counter()
        scored = self._score(batch, draft, pending)
        verdict = self._verify(batch, draft, pending, scored)
        num_new = verdict.num_new.tolist()                                       # [B] as Python ints, once
        first_new = self._commit(seqs, batch, draft, verdict, num_new)
        self._note_logprobs(seqs, scored.logits, verdict.path, num_new)
        t2 = time.perf_counter()
        self.proposer.commit(batch, verdict, scored.hidden)
        if self.predictions:
            self.predictions.commit([s.row for s in seqs], [s.generated for s in seqs], num_new,
                                    draft.offered().masked_fill(~draft.predicted, 0).tolist())
        t3 = time.perf_counter()
        self._record(seqs, k, draft, verdict, num_new, t1 - t0 + t3 - t2, t2 - t1)
        lengths = self.cache.lengths.tolist()
        for s, first in zip(seqs, first_new):
            self._check_end(s, first)
            if not s.done:
                assert lengths[s.row] == len(s.tokens) - 1, "target cache out of step with tokens"

    def _propose(self, seqs: list[SequenceState], batch: ActiveBatch, k: int) -> Draft:
        """The batch drafts k tokens (the policy's choice within the batch's room: `_speculate`; rows with a
        prediction: from it); each row keeps one fewer than its remaining tokens (a row that does not speculate:
        only its prediction's), and no step drafts more nodes than the cache has room for or than a forward scores
        exactly (MAX_TREE_BUDGET)."""
        B, dev = len(seqs), self.target.device
        room = min(self._room(s) for s in seqs)
        conts = self.predictions.continuations([s.row for s in seqs], min(PREDICTION_DRAFT_TOKENS, room))
        if k and not all(conts):
            draft = self.proposer.propose(batch, k)
            check_draft(draft, B, k, self.target.vocab_size)            # what the verifier trusts
        else:
            draft = Draft.empty(B, dev)
        draft = with_predictions(draft, conts)
        if draft.tokens.shape[1] == 0:
            return draft
        keep = torch.tensor([s.request.max_new_tokens - s.num_generated - 1      # a row that does not speculate
                             if s.request.speculate or c else 0 for s, c in zip(seqs, conts)], device=dev)  # [B]
        return draft.first_nodes(min(room, MAX_TREE_BUDGET)).cut(keep).trimmed()

    def _score(self, batch: ActiveBatch, draft: Draft, pending: Tensor) -> Scored:
        """One target forward over each row's pending token and its drafts: a chain causally, a tree under
        its ancestor mask, every node at the position of its depth."""
        B, K = draft.tokens.shape
        lengths = self.cache.lengths[batch.rows][:, None]                                # [B, 1]
        if draft.is_chain:                                # causal; a plain step (K = 0) needs no depths
            nodes = torch.cat([pending[:, None], draft.tokens], 1) if K else pending[:, None]   # [B, K+1]
            positions = lengths + torch.arange(K + 1, device=pending.device) if K else lengths  # [B, K+1]
            mask = None
        else:
            tree = draft.tree(pending)
            nodes, mask = tree.tokens, tree.mask()                                       # [B, N], [B, N, N]
            positions = lengths + tree.depth()                                           # [B, N]
        if draft.reuse is not None:                       # the proposer ran the target's first layers already
            hidden = self.target.forward_reusing(draft.reuse, positions, self.cache, batch.rows, self.features)
        else:
            ids = nodes.clamp(min=0) if K else nodes                                     # PAD drafts score as 0
            hidden = self.target(ids, positions, self.cache, batch.rows, mask, self.features)  # [B, N, H']
        if self._greedy(batch, draft):
            logits, top = self.target.lm_head_top(hidden)                                # [B, N, V], [B, N]
            return Scored(hidden, logits, positions, True, top)
        return Scored(hidden, self.target.lm_head(hidden), positions, False, positions.new_empty(B, 0))

    @staticmethod
    def _greedy(batch: ActiveBatch, draft: Draft) -> bool:
        """Whether the target's argmax decides the whole step: greedy rows verifying a chain of point masses."""
        return draft.is_chain and batch.sampling.greedy and (draft.probs is None or not bool(draft.sampled.any()))

    def _verify(self, batch: ActiveBatch, draft: Draft, pending: Tensor, scored: Scored) -> Verdict:
        """What the target keeps of the drafts (verify.py).

        A row scored at position t gives the distribution of the token at t + 1, decided by
        u(seed, t + 1, TARGET) (and a sampled draft's acceptance by u(seed, t + 1, ACCEPT)) whichever
        step scores it. A position scored now but not committed (past the first rejection) is scored
        again next step with the same uniforms. That stays exact: verification stops at the first
        rejection, so nothing this step commits or reports (tokens, accepted counts) depended on them,
        and they are as fresh next step as if never computed. Sampled drafts are drawn afresh at every
        step (sampling.step_seeds), so the same holds for the draws behind them."""
        if scored.greedy:
            return follow(draft.tokens, scored.top)                # the target's argmax: no distribution nor uniform
        probs = to_probs(scored.logits, batch.sampling)                                     # [B, N, V]
        u_target = position_uniforms(batch.seeds, scored.positions + 1, Stream.TARGET)          # [B, N]
        if not draft.is_chain:
            return verify_tree(draft.tree(pending), probs, u_target)
        u_accept = position_uniforms(batch.seeds, scored.positions[:, :-1] + 1, Stream.ACCEPT)  # [B, K]
        return verify(draft, probs, u_target, u_accept)

    def _commit(self, seqs: list[SequenceState], batch: ActiveBatch, draft: Draft, verdict: Verdict,
                num_new: list[int]) -> list[int]:
        """The target's cache keeps the committed path's rows (a chain's: its scratch prefix, already in place);
        the sequences take their num_new new tokens (where each one's new tokens start is returned)."""
        if draft.is_chain:
            self.cache.advance(batch.rows, verdict.num_new)
        else:
            self.cache.commit(batch.rows, verdict.path, verdict.num_new)
        first_new = [len(s.tokens) for s in seqs]
        for s, tokens, n in zip(seqs, verdict.tokens.tolist(), num_new):
            s.tokens.extend(tokens[:n])
        return first_new

    def _scored_prompt(self, hidden: Tensor, tokens: list[int], top: int) -> list[TokenLogprob]:
        """hidden [P-1, H]: the prompt's rows but its last -> the log-probabilities of the tokens they predict,
        the prompt's second to last (the LM head runs on PROMPT_HEAD_ROWS rows at a time: a long prompt's logits
        would take gigabytes at once)."""
        out = []
        for start in range(0, len(tokens), PROMPT_HEAD_ROWS):
            logits = self.target.lm_head(hidden[start:start + PROMPT_HEAD_ROWS])                   # [<=R, V]
            out += token_logprobs(logits, tokens[start:start + PROMPT_HEAD_ROWS], top)
        return out

    def _note_logprobs(self, seqs: list[SequenceState], logits: Tensor, path: Tensor, num_new: list[int]) -> None:
        """The log-probabilities of the tokens each sequence just committed, for the sequences that ask:
        logits [B, N, V] of the scored rows, path [B, >= n] the rows that decided the n new tokens."""
        for b, (s, n) in enumerate(zip(seqs, num_new)):
            if s.request.logprobs:
                rows = logits[b, path[b, :n]]                                              # [n, V]
                s.logprobs += token_logprobs(rows, s.tokens[-n:], s.request.top_logprobs)

    def _record(self, seqs: list[SequenceState], asked: int, draft: Draft, verdict: Verdict, num_new: list[int],
                draft_s: float, target_s: float) -> None:
        """Each sequence's counters and the draft-length policy learn the step's outcome (`asked`: the drafts the
        proposer was asked for)."""
        offered = draft.offered()                                                          # [B]
        offered_n = offered.tolist()
        predicted = [p and v > 0 for p, v in zip(draft.predicted.tolist(), offered_n)]
        for s, valid, n, pred in zip(seqs, offered_n, num_new, predicted):
            s.counters.record_step(valid, n - 1, n, pred)
            s.counters.draft_seconds += draft_s
            s.counters.target_seconds += target_s
        if not any(predicted):        # the policy learns the method's drafts, not the predictions'
            self.policy.observe(len(seqs), draft.length, offered, verdict.num_accepted, draft_s, target_s, asked=asked)

    # ---- stopping and text --------------------------------------------------------
    def _check_end(self, s: SequenceState, first_new: int) -> None:
        """End `s` at an EOS among its new tokens s.tokens[first_new:] (dropping what follows it), or
        at max_new_tokens (dropping the excess)."""
        prompt = len(s.request.prompt)
        for i in range(max(first_new, prompt), len(s.tokens)):
            if s.tokens[i] in self.eos_ids:
                s.counters.drop_last(len(s.tokens) - (i + 1))
                del s.tokens[i + 1:]
                del s.logprobs[s.num_generated:]
                s.finish_reason = "stop"
                return
        extra = len(s.tokens) - prompt - s.request.max_new_tokens
        if extra >= 0:
            if extra:
                del s.tokens[-extra:]
                del s.logprobs[s.num_generated:]
                s.counters.drop_last(extra)
            s.finish_reason = "length"

    def _emit(self, s: SequenceState) -> str:
        """The text of the tokens committed since the last call (an EOS that ended `s` shows none); partial
        characters and possible stop-string beginnings are held back until `s` ends. A stop string ends `s`
        at the token that completes it: tokens the same step committed after it are dropped (and not
        counted), so the tokens and their count do not depend on how many tokens a step commits."""
        start = s.read
        new = s.tokens[start:]
        s.read = len(s.tokens)
        if new and new[-1] in self.eos_ids:
            new = new[:-1]
        piece, used = s.output.feed(new, final=s.done)
        if s.output.stopped:
            s.finish_reason = "stop"
            cut = len(s.tokens) - (start + used)
            if cut:
                del s.tokens[start + used:]
                del s.logprobs[s.num_generated:]
                s.counters.drop_last(cut)
                s.read = len(s.tokens)
        s.text += piece
        return piece
