"""A draft model with another tokenizer, by token-level intersection (TLI): exact under sampling too.

The draft may only propose tokens whose text is also one token of the target's vocabulary (the
intersection, found by decoding every token string through each tokenizer's own decoder); its
distribution, restricted to them and renormalised, is a distribution q over target tokens, so the
rejection rule and the residual max(0, p - q) keep the output exactly the target's. The draft reads
the committed text re-tokenized with its own tokenizer: each step, the longest common prefix of that
re-tokenization and what its cache holds stays, the rest is fed. The draft reads at most the last
`context` tokens of the prompt (its first sync feeds no more), so a long prompt costs a bounded
catch-up, paid only when the method first drafts (the `auto` policy may never do so); what the draft
does not read changes its guesses, never the output.
"""
from __future__ import annotations

import torch
from torch import Tensor

from ..errors import SpecdecError
from ..models.base import CausalLM
from ..models.tokenizer import Tokenizer
from ..sampling import Stream, argmax, position_uniforms, sample, step_seeds, to_probs
from ..tree import PAD
from ..verify import Draft, Verdict
from .base import ActiveBatch
from .draft_model import same_prefix

MIN_OVERLAP = 0.1            # below this share of the draft's vocabulary in common, drafting is pointless
DRAFT_CONTEXT = 64           # draft tokens of the prompt the draft reads (the most recent ones): its catch-up
                             # is what `auto` pays before it knows whether drafting pays (gemma3-270m + smollm2,
                             # mini suite: 128 tokens made RAG 0.91x under `auto`, 64 0.95x; fixed K = 4 on math
                             # accepts less with 64, tau 3.84 -> 2.40)
PREFILL_FEED = 8             # a row feeding more tokens than this at once (a prompt) takes the prefill path


def token_texts(tok: Tokenizer) -> list[str]:
    """The text of every token id ("" for special tokens and pieces of a character)."""
    special = {i for i, t in tok.backend.get_added_tokens_decoder().items() if t.special}
    out = [""] * tok.backend.get_vocab_size()
    for i in range(len(out)):
        try:
            text = "" if i in special else tok.token_bytes(i).decode("utf-8")
        except UnicodeDecodeError:                                  # a piece of a character
            continue
        if "\ufffd" not in text:
            out[i] = text
    return out


def canonical(tok: Tokenizer, text: str, ids: list[int]) -> int:
    """Of several ids spelled `text` (a byte-fallback token <0x2E> and the token "."), the one `tok` writes
    for it: a draft proposing the other would never be accepted."""
    enc = tok.encode_text(text)
    return enc[0] if len(enc) == 1 and enc[0] in ids else ids[0]


def target_probs(q: Tensor, d2t: Tensor, allowed: Tensor, target_vocab: int) -> Tensor:
    """The draft's q [B, V_draft] as a distribution over target ids [B, V_target]: a target token's
    probability is the sum over every draft token mapped onto it (two draft tokens may spell the same
    text, e.g. "a" and its byte-fallback twin, and map to one target id)."""
    qt = torch.zeros(q.shape[0], target_vocab, dtype=q.dtype, device=q.device)
    return qt.index_add_(1, d2t[allowed], q[:, allowed])


class VocabMap:
    """Draft id -> target id for the tokens both vocabularies spell the same (-1 elsewhere)."""

    def __init__(self, draft_tok: Tokenizer, target_tok: Tokenizer, target_vocab: int) -> None:
        ids_of: dict[str, list[int]] = {}
        for i, t in enumerate(token_texts(target_tok)):
            if t and i < target_vocab:
                ids_of.setdefault(t, []).append(i)
        target = {t: ids[0] if len(ids) == 1 else canonical(target_tok, t, ids) for t, ids in ids_of.items()}
        d = token_texts(draft_tok)
        self.d2t = torch.tensor([target.get(t, -1) if t else -1 for t in d], dtype=torch.long)   # [V_draft]
        self.shared = int((self.d2t >= 0).sum())
        self.draft_vocab, self.target_vocab = len(d), target_vocab

    @property
    def overlap(self) -> float:
        """The share of the draft's vocabulary it can propose."""
        return self.shared / self.draft_vocab

    def describe(self) -> str:
        return (f"{self.shared} tokens in common: {100 * self.overlap:.1f}% of the draft's {self.draft_vocab}, "
                f"{100 * self.shared / self.target_vocab:.1f}% of the target's {self.target_vocab}")


class CrossVocabProposer:
    name = "draft"
    feature_layers: tuple[int, ...] = ()                 # the target layers it reads: none

    def __init__(self, draft: CausalLM, draft_tok: Tokenizer, target_tok: Tokenizer, target_vocab: int,
                 context: int = DRAFT_CONTEXT) -> None:
        if context < 1:
            raise SpecdecError(f"the draft's context must be at least one token, got {context}")
        self.draft, self.draft_tok, self.target_tok, self.context = draft, draft_tok, target_tok, context
        self.map = VocabMap(draft_tok, target_tok, target_vocab)
        if self.map.overlap < MIN_OVERLAP:
            raise SpecdecError(f"the draft shares too little of its vocabulary with the target ({self.map.describe()}); "
                               f"token-level intersection needs at least {100 * MIN_OVERLAP:.0f}%")
        dev = draft.device
        self.d2t = self.map.d2t.to(dev)
        self.allowed = self.d2t >= 0                                           # [V_draft]
        self.fed: dict[int, list[int]] = {}                                    # row -> draft tokens in the cache
        self.skip: dict[int, int] = {}                                         # row -> leading draft tokens not read
        self.drafted = torch.zeros(0, dtype=torch.long)                        # [B] provisional drafts fed
        self.last = torch.zeros(0, 0, dtype=torch.long)                        # [B, k] last drafts (target ids)

    def allocate(self, rows: int, slots: int) -> None:
        self.cache = self.draft.new_cache(rows, 2 * slots)                    # draft tokens may outnumber target's
        self.fed = {}

    def start(self, rows: Tensor, prompts: list[list[int]], hidden: Tensor) -> None:
        self.cache.truncate(rows, torch.zeros_like(rows))
        for r in rows.tolist():
            self.fed[r] = []
            self.skip[r] = -1                                                  # set by the first sync

    def _retokenize(self, target_ids: list[int]) -> list[int]:
        text = self.target_tok.decode(target_ids)
        return self.draft_tok.encode_text(text) or [0]

    def _sync(self, rows: Tensor, histories: list[list[int]], room: int) -> Tensor:
        """Bring every row's cache to its committed text, leaving `room` slots for the step's drafts; the draft's
        logits [B, V_draft] after it. A row whose text outgrows the draft's cache reads its last `context`
        tokens afresh (the draft's own context may be shorter than the target's)."""
        dev = self.draft.device
        feeds = []
        for i, (r, h) in enumerate(zip(rows.tolist(), histories)):
            want = self._retokenize(h)
            if self.skip[r] < 0 or len(want) - self.skip[r] + room > self.cache.slots:
                self.skip[r] = max(0, len(want) - min(self.context, self.cache.slots - room))
            want, have = want[self.skip[r]:] or want[-1:], self.fed[r]
            n = 0
            while n < min(len(want), len(have)) and want[n] == have[n]:
                n += 1
            n = min(n, len(want) - 1)                                          # always feed at least one token
            self.cache.truncate(rows[i:i + 1], torch.tensor([n], device=dev))
            self.fed[r] = want
            feeds.append(want[n:])
        logits = torch.empty(len(feeds), self.map.draft_vocab, device=dev)
        long = [i for i, f in enumerate(feeds) if len(f) > PREFILL_FEED]
        for i in long:                                  # a prompt: the prefill path (fast for many tokens)
            row, f = rows[i:i + 1], feeds[i]
            pos = (self.cache.lengths[row][:, None] + torch.arange(len(f), device=dev)).clamp(max=self.draft.max_seq_len - 1)
            h = self.draft.prefill(torch.tensor([f], device=dev), pos, self.cache, row)   # [1, T, H]
            self.cache.commit(row, torch.arange(len(f), device=dev)[None], torch.tensor([len(f)], device=dev))
            logits[i] = self._masked(self.draft.lm_head(h[:, -1]))[0]
        short = [i for i in range(len(feeds)) if i not in long]
        if short:
            idx = torch.tensor(short, device=dev)
            take = torch.tensor([len(feeds[i]) for i in short], device=dev)
            inp = torch.zeros(len(short), int(take.max()), dtype=torch.long, device=dev)
            for j, i in enumerate(short):
                inp[j, :len(feeds[i])] = torch.tensor(feeds[i])
            logits[idx] = self._step(inp, rows[idx], take).to(logits.dtype)
        return logits

    def _step(self, tokens: Tensor, rows: Tensor, take: Tensor) -> Tensor:
        dev = self.draft.device
        start = self.cache.lengths[rows]
        pos = (start[:, None] + torch.arange(tokens.shape[1], device=dev)).clamp(max=self.draft.max_seq_len - 1)
        h = self.draft(tokens, pos, self.cache, rows)
        self.cache.commit(rows, torch.arange(tokens.shape[1], device=dev).expand_as(tokens), take)
        return self._masked(self.draft.lm_head(h[torch.arange(h.shape[0], device=dev), take - 1]))

    def _masked(self, logits: Tensor) -> Tensor:
        return logits.masked_fill(~self.allowed, float("-inf"))              # only shared tokens

    def propose(self, batch: ActiveBatch, k: int) -> Draft:
        dev = self.draft.device
        rows = batch.rows.to(dev)
        B = rows.numel()
        logits = self._sync(rows, batch.tokens, k + 1)                         # [B, V_draft]
        sampled = bool((batch.sampling.temperature > 0).any())
        first = torch.tensor([len(t) for t in batch.tokens], device=dev)
        u = position_uniforms(step_seeds(batch.seeds.to(dev), first), first[:, None] + torch.arange(k, device=dev),
                              Stream.DRAFT)
        tokens = torch.full((B, k), PAD, dtype=torch.long, device=dev)
        qs: list[Tensor] = []
        for i in range(k):
            if sampled:
                q = to_probs(logits[:, None], batch.sampling)[:, 0]            # [B, V_draft]; greedy rows one-hot
                x = sample(q, u[:, i])
                qs.append(target_probs(q, self.d2t, self.allowed, self.map.target_vocab))
            else:
                x = argmax(logits)
            tokens[:, i] = self.d2t[x]
            if i < k - 1:
                logits = self._step(x[:, None], rows, torch.ones(B, dtype=torch.long, device=dev))
                for j, r in enumerate(rows.tolist()):
                    self.fed[r] = self.fed[r] + [int(x[j])]
        self.drafted = torch.full((B,), k - 1, dtype=torch.long, device=dev)
        self.last = tokens
        return Draft(tokens, torch.stack(qs, 1) if sampled else None)

    def forget(self) -> None:
        pass                          # nothing outlives a request

    def commit(self, batch: ActiveBatch, verdict: Verdict, hidden: Tensor) -> None:
        """Keep the fed drafts that were committed; the rest (and the final token) come with the next sync."""
        rows = batch.rows.to(self.draft.device)
        if self.drafted.numel() != rows.numel():
            return                                                             # a step without drafts
        keep = torch.minimum(torch.minimum(verdict.num_accepted.to(rows.device), self.drafted),
                             same_prefix(self.last, verdict.tokens, int(self.drafted.max())))
        for j, r in enumerate(rows.tolist()):
            drop = int(self.drafted[j] - keep[j])
            if drop:
                self.fed[r] = self.fed[r][:-drop]
        self.cache.truncate(rows, self.cache.lengths[rows] - (self.drafted - keep))
        self.drafted = torch.zeros(0, dtype=torch.long)
