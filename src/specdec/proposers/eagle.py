"""EAGLE proposer: a feature-level draft head growing a dynamic token tree (EAGLE-2 style).

Drives an EAGLE head (the target's last hidden state) or an EAGLE-3 head (fused low/mid/high
features): both take (feature, next token) pairs and turn their own outputs into the next draft's
feature, so drafting is the same loop.

State per sequence: the head's KV cache holds pairs (f_i, x_{i+1}) for every
committed position i, and `pred` is the head's output at the last one (the
predicted feature of the pending token's position). Committed pairs wait in `unfed` until the
sequence drafts next: steps that draft nothing (the draft-length policy's plain steps, the
prompt-lookup rows of `hybrid`) cost the head nothing, and one forward catches up on all of them. Drafting expands, depth by
depth, the `topk` best nodes by cumulative draft log-probability, each into its
`topk` best children; the `budget` best nodes overall form the tree the target
verifies (topk = 1 drafts a plain chain instead). After verification the accepted path's true target features are fed
back, so drafting always restarts from exact features.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import Tensor

from ..errors import SpecdecError
from ..models.eagle import EagleHead
from ..models.eagle3 import Eagle3Head
from ..sampling import Stream, position_uniforms, sample, step_seeds, to_probs
from ..tree import PAD
from ..verify import ROOT, Draft, Verdict
from .base import ActiveBatch


CATCH_UP_WINDOW = 128   # pairs a head catches up on at most (its training windows' length): see _catch_up


class EagleProposer:
    name = "eagle"
    feature_layers: tuple[int, ...] = ()                 # the head's (EAGLE-3: low/middle/high target layers)

    def __init__(self, head: EagleHead | Eagle3Head, topk: int = 4, depth: int = 5, budget: int = 16,
                 min_confidence: float = 0.0, name: str = "eagle", sample_from: float = math.inf) -> None:
        """min_confidence: a chain stops where the head's cumulative probability of its drafts falls
        below it (0 = always draft `depth` tokens); drafts that would rarely be accepted cost
        target compute and head forwards for nothing. Each sequence's chain is cut by its own
        confidence; the batch drafts until every chain has stopped. Trees use `budget` instead.
        sample_from: a chain's rows whose temperature is at least this (and above 0) draw their drafts from
        the head's own q (through the row's sampling transform) instead of drafting its argmax: accepted with
        probability 1 - TV(p, q) rather than p(argmax q), still exact by the rejection rule, but not
        seed-equal to plain decoding (inf: no row; 0: every row that samples)."""
        if sample_from != math.inf and topk != 1:
            raise SpecdecError("sampled drafts are chains: a draft tree (topk > 1) drafts point masses")
        self.head, self.topk, self.depth, self.budget, self.name = head, topk, depth, budget, name
        self.sample_from = sample_from
        self.support = head.vocab_ids.sort().values          # [V'] the head's ids ascending: where a sampled q > 0
        self.feature_layers = head.feature_layers
        self.log_min_confidence = math.log(min_confidence) if min_confidence > 0 else -math.inf
        self.pred: dict[int, Tensor] = {}
        self.unfed: dict[int, tuple[list[int], list[Tensor]]] = {}   # row -> committed tokens, target features

    def allocate(self, rows: int, slots: int) -> None:
        scratch = self.topk * self.depth + 2                  # a tree's nodes past the rows' slots, at the context's end too
        self.cache = self.head.new_cache(rows, slots + scratch, past_context=scratch)

    def _feed(self, rows: Tensor, tokens: list[list[int]], target_feats: list[Tensor]) -> None:
        """Commit pairs (the head's input feature of target_feats[i], tokens[i]) after each row's head
        cache; remember the last output."""
        feats = [self.head.input_features(x) for x in target_feats]
        B = len(tokens)
        T = max(len(t) for t in tokens)
        dev = self.head.fc.weight.device
        tok = torch.zeros(B, T, dtype=torch.long, device=dev)
        f = torch.zeros(B, T, feats[0].shape[-1], dtype=self.head.fc.weight.dtype, device=dev)
        n = torch.tensor([len(t) for t in tokens], device=dev)
        for i, (t, x) in enumerate(zip(tokens, feats)):
            tok[i, :len(t)] = torch.tensor(t)
            f[i, :len(t)] = x
        base = self.cache.lengths[rows]
        # a short row's padding may run past the rotary table: its entries are never kept, any position serves
        pos = (base[:, None] + torch.arange(T, device=dev)).clamp(max=self.head.max_seq_len - 1)   # [B, T]
        out = self.head(tok, f, pos, self.cache, rows)
        self.cache.commit(rows, torch.arange(T, device=dev).expand(B, T), n)
        for i, r in enumerate(rows.tolist()):
            self.pred[r] = out[i, int(n[i]) - 1]

    def _catch_up(self, rows: Tensor) -> None:
        """Feed the head every pair committed for `rows` since they last drafted (one forward). A row with more
        than CATCH_UP_WINDOW waiting (a prompt, a long run of plain steps) starts its head cache afresh on the
        last CATCH_UP_WINDOW of them: the head was trained on windows that long, and rotary attention sees the
        same relative positions from any start, so its drafts hardly change, while a catch-up over a whole
        document cost more than the drafts it enabled gain (0.4 ms a pair on one thread of an AMD EPYC Zen 3)."""
        todo = [r for r in rows.tolist() if r in self.unfed]
        if not todo:
            return
        waiting = [self.unfed.pop(r) for r in todo]
        at = torch.tensor(todo, device=rows.device)
        long = [i for i, (t, _) in enumerate(waiting) if len(t) > CATCH_UP_WINDOW]
        if long:
            self.cache.truncate(at[long], torch.zeros(len(long), dtype=torch.long, device=rows.device))
            for i in long:
                t, f = waiting[i]
                waiting[i] = (t[-CATCH_UP_WINDOW:], [torch.cat(f)[-CATCH_UP_WINDOW:]])
        longest = max(len(t) for t, _ in waiting)
        if int(self.cache.lengths[at].max()) + longest <= self.cache.slots:
            self._feed(at, [t for t, _ in waiting], [torch.cat(f) for _, f in waiting])
            return
        for i, (t, f) in enumerate(waiting):      # padded to the longest, a long row's scratch would overflow
            self._feed(at[i:i + 1], [t], [torch.cat(f)])

    def _wait(self, rows: Tensor, tokens: list[list[int]], target_feats: list[Tensor]) -> None:
        for r, t, f in zip(rows.tolist(), tokens, target_feats):
            toks, feats = self.unfed.setdefault(r, ([], []))
            toks.extend(t)
            feats.append(f)

    def start(self, rows: Tensor, prompts: list[list[int]], hidden: Tensor) -> None:
        self.cache.truncate(rows, torch.zeros_like(rows))
        for r in rows.tolist():
            self.unfed.pop(r, None)
            self.pred.pop(r, None)
        toks = [p[1:] for p in prompts]                           # x_{i+1} for i = 0 .. P-1
        self._wait(rows, toks, [hidden[i, :len(t)] for i, t in enumerate(toks)])

    def forget(self) -> None:
        pass                          # nothing outlives a request

    def commit(self, batch: ActiveBatch, verdict: Verdict, hidden: Tensor) -> None:
        rows = batch.rows
        n = verdict.num_new.tolist()
        path = verdict.path
        toks = [verdict.tokens[i, :n[i]].tolist() for i in range(len(n))]
        feats = [hidden[i, path[i, :n[i]]] for i in range(len(n))]
        self._wait(rows, toks, feats)

    @torch.inference_mode()
    def propose(self, batch: ActiveBatch, k: int) -> Draft:
        """Grow candidates depth by depth from the head's prediction for the pending token's position; a
        chain (topk 1) is the draft, cut where its confidence falls too low, a tree keeps the best nodes."""
        rows = batch.rows
        self._catch_up(rows)
        pred = torch.stack([self.pred[r] for r in rows.tolist()])  # [B, H]
        sampled = self.samples(batch)
        if bool(sampled.any()):
            return self._sampled_chain(batch, pred, min(self.depth, k), sampled.to(pred.device))
        if self.topk == 1:             # a chain: verified as one (cheaper than a tree forward), q a point mass
            return self._chain(pred, min(self.depth, k), rows)
        grown = self._first_level(pred)
        for d in range(1, min(self.depth, k)):                     # feed depth-d frontier -> depth d+1 children
            self._expand(grown, d, pred, rows)
        tok, par, score, depth = (torch.cat(x, 1) for x in (grown.tok, grown.par, grown.score, grown.depth))
        return self._select(tok, par, score, depth)

    def _chain(self, pred: Tensor, k: int, rows: Tensor) -> Draft:
        """Up to k drafts per row, each the head's argmax from its predecessor's output (pred [B, H] for the
        first). Each draft is fed alone (one token per row and forward, T = 1) and kept in the head's cache
        while the chain grows, so the next one attends to it without feeding it again; the cache rolls back
        to the committed pairs at the end. A row's chain is cut where its cumulative head log-probability
        falls below min_confidence; the batch drafts until every chain has stopped."""
        head = self.head
        vocab = head.vocab_ids.to(pred.device)
        base = self.cache.lengths[rows].clone()                                       # [B] committed pairs
        lp, j = torch.log_softmax(head.logits(pred), -1).max(-1)                      # [B]
        toks, scores, out = [vocab[j]], [lp], pred
        try:
            for d in range(1, k):
                if bool((scores[-1] < self.log_min_confidence).all()):
                    break                                          # every chain fell below min_confidence
                out = self._feed_draft(toks[-1], out, base + d - 1, rows)
                lp, j = torch.log_softmax(head.logits(out), -1).max(-1)
                toks.append(vocab[j])
                scores.append(scores[-1] + lp)
        finally:
            self.cache.truncate(rows, base)
        low = torch.stack(scores, 1) < self.log_min_confidence                       # cumulative: a suffix of each chain
        return Draft(torch.stack(toks, 1).masked_fill(low, PAD))                      # [B, n], one node per depth

    def _feed_draft(self, tok: Tensor, feat: Tensor, at: Tensor, rows: Tensor) -> Tensor:
        """One draft per row, token tok [B] with feature feat [B, H] at head positions at [B], through the head;
        its key stays in the head's cache for the chain's next depth (the chain rolls the cache back when it
        ends) -> the head's output [B, H], the next draft's feature."""
        out = self.head(tok[:, None], feat[:, None], at[:, None], self.cache, rows)[:, 0]
        self.cache.commit(rows, torch.zeros_like(tok)[:, None], torch.ones_like(tok))
        return out

    def samples(self, batch: ActiveBatch) -> Tensor:
        """[B] bool: the rows that draw their drafts from the head's q (temperature > 0 and >= sample_from)."""
        t = batch.sampling.temperature
        return (t > 0) & (t >= self.sample_from)

    def _sampled_chain(self, batch: ActiveBatch, pred: Tensor, k: int, sampled: Tensor) -> Draft:
        """A chain of up to k drafts, with q [B, k, V]: rows in `sampled` [B] draw theirs from the head's q,
        the others draft its argmax (point masses, verified as such: seed-equal to plain decoding). Depth d
        feeds the depth-d draft alone (its predecessor's head output as feature) after the head's cache and the
        drafts before it, as the point-mass chain does. Every row stops where the head's cumulative top
        probability along its chain falls below min_confidence, the point-mass chain's rule (a stopping rule
        on the head's outputs only: the rejection rule stays exact); the batch drafts until all have stopped.
        (Cut on the cumulative q of its own sampled drafts instead, a chain drafted at half as many steps and
        committed fewer tokens per forward at temperature 1.0 on the mini suite: a sampled draft's q is often
        low where its acceptance, 1 - TV(p, q), is not.)"""
        rows, dev = batch.rows, pred.device
        B = pred.shape[0]
        first = torch.tensor([len(t) for t in batch.tokens], device=dev)                # [B] the first draft's position
        u = position_uniforms(step_seeds(batch.seeds.to(dev), first), first[:, None] + torch.arange(k, device=dev),
                              Stream.DRAFT)                                              # [B, k]
        vocab_ids = self.head.vocab_ids.to(dev)
        support = self.support.to(dev)                                                   # [V'] ascending ids
        V = self.head.tgt.vocab_size
        base = self.cache.lengths[rows].clone()                                           # [B] committed pairs
        out, toks, qs, top = pred, [], [], []
        conf = torch.zeros(B, device=dev)                                                 # cumulative log top probability
        try:
            for d in range(k):
                head_logits = self.head.logits(out).float()                              # [B, V'] over the head's vocab
                lp, j = torch.log_softmax(head_logits, -1).max(-1)                       # [B] its top token and log-prob
                logits = torch.full((B, V), float("-inf"), device=dev)
                logits[:, vocab_ids] = head_logits                                       # [B, V], -inf off the head's vocab
                q = to_probs(logits[:, None], batch.sampling)[:, 0]                      # [B, V]
                argmax = vocab_ids[j]
                # q is 0 off the head's vocabulary, so drawing over it in id order draws the token (and the float64
                # sums) of drawing over all of q, for a sixth of the work
                drawn = support[sample(q[:, support], u[:, d])]
                if not bool(sampled.all()):
                    q = torch.where(sampled[:, None], q, torch.zeros_like(q).scatter_(-1, argmax[:, None], 1.0))
                toks.append(torch.where(sampled, drawn, argmax))
                qs.append(q)
                conf = conf + lp
                top.append(conf)
                if d == k - 1 or bool((conf < self.log_min_confidence).all()):
                    break                                                                 # every chain has stopped
                out = self._feed_draft(toks[-1], out, base + d, rows)
        finally:
            self.cache.truncate(rows, base)
        tokens, probs = torch.stack(toks, 1), torch.stack(qs, 1)                          # [B, n], [B, n, V]
        low = torch.stack(top, 1) < self.log_min_confidence                               # cumulative: a suffix of each chain
        return Draft(tokens.masked_fill(low, PAD), probs, sampled=sampled)

    def _first_level(self, pred: Tensor) -> "Candidates":
        """The topk children of the pending token from the head's prediction pred [B, H]."""
        K, dev = self.topk, pred.device
        B = pred.shape[0]
        s, j = torch.log_softmax(self.head.logits(pred), -1).topk(K, -1)           # [B, K]
        return Candidates(tok=[self.head.vocab_ids.to(dev)[j]], par=[torch.full((B, K), ROOT, device=dev)],
                          score=[s], depth=[torch.ones(B, K, dtype=torch.long, device=dev)],
                          frontier=torch.arange(K, device=dev).expand(B, K), outs=pred[:, None], total=K)

    def _expand(self, grown: "Candidates", d: int, pred: Tensor, rows: Tensor) -> None:
        """Feed the depth-d frontier to the head (with every node expanded before it, under their tree
        mask) and add each frontier node's topk children; the best topk of them are the next frontier."""
        head, K = self.head, self.topk
        B, dev = pred.shape[0], pred.device
        all_par = torch.cat(grown.par, 1)
        if d == 1:
            feat = pred[:, None].expand(B, K, pred.shape[-1])
        else:                                                      # parent's predicted feature
            fpar = all_par.gather(1, grown.frontier)               # [B, K] parents, all expanded earlier
            slot = (torch.cat(grown.expanded, 1)[:, None, :] == fpar[..., None]).float().argmax(-1)
            feat = grown.outs.gather(1, slot[..., None].expand(B, K, grown.outs.shape[-1]))
        grown.expanded.append(grown.frontier)
        grown.feats.append(feat)
        e_ids = torch.cat(grown.expanded, 1)                       # [B, E] every expanded node so far
        e_tok = torch.cat(grown.tok, 1).gather(1, e_ids)
        e_depth = torch.cat(grown.depth, 1).gather(1, e_ids)
        base = self.cache.lengths[rows]                            # head positions of the first draft layer
        mask = ancestor_mask(e_ids, all_par.gather(1, e_ids))
        grown.outs = head(e_tok, torch.cat(grown.feats, 1), base[:, None] + e_depth - 1, self.cache, rows, mask)
        lp = torch.log_softmax(head.logits(grown.outs[:, -K:]), -1)  # [B, K, V'] from the frontier's outputs
        cs, cj = lp.topk(K, -1)                                    # [B, K, K]
        cscore = (score_of(grown.score, grown.frontier)[..., None] + cs).view(B, K * K)
        grown.tok.append(head.vocab_ids.to(dev)[cj].view(B, K * K))
        grown.par.append(grown.frontier[..., None].expand(B, K, K).reshape(B, K * K))
        grown.score.append(cscore)
        grown.depth.append(torch.full((B, K * K), d + 1, dtype=torch.long, device=dev))
        grown.frontier = grown.total + cscore.topk(K, -1).indices  # expand the best K children next
        grown.total += K * K

    def _select(self, tok: Tensor, par: Tensor, score: Tensor, depth: Tensor) -> Draft:
        """The `budget` best nodes (parents before children) as a tree under the pending token."""
        B, M = tok.shape
        n = min(self.budget, M)
        out_tok = torch.full((B, n), PAD, dtype=torch.long)
        out_par = torch.full((B, n), ROOT, dtype=torch.long)
        order = torch.argsort(score - 1e-6 * depth, dim=-1, descending=True).tolist()
        tl, pl = tok.tolist(), par.tolist()
        for b in range(B):
            where: dict[int, int] = {}                             # candidate node -> its index in the draft
            for node in order[b]:
                if len(where) == n:
                    break
                p = pl[b][node]
                if p != ROOT and p not in where:
                    continue                                       # its parent did not make the cut
                where[node] = len(where)
                out_tok[b, where[node]] = tl[b][node]
                out_par[b, where[node]] = ROOT if p == ROOT else where[p]
        dev = tok.device
        return Draft(out_tok.to(dev), parents=out_par.to(dev))


@dataclass
class Candidates:
    """Draft candidates grown so far, level by level: every node's token, parent (ROOT: the pending
    token; else a node id, counting across levels), cumulative draft log-probability and depth."""
    tok: list[Tensor]                  # per level [B, n]
    par: list[Tensor]
    score: list[Tensor]
    depth: list[Tensor]
    frontier: Tensor                   # [B, topk] the node ids to expand next
    outs: Tensor                       # [B, E, H] the head's outputs of the expanded nodes (at first: pred)
    total: int                         # nodes so far
    expanded: list[Tensor] = field(default_factory=list)   # expanded node ids, in feeding order
    feats: list[Tensor] = field(default_factory=list)      # their input features


def ancestor_mask(ids: Tensor, parents: Tensor) -> Tensor:
    """[B, E, E] node c attends to itself and its ancestors, for nodes ids [B, E] with parents [B, E]
    (ancestors precede descendants)."""
    B, E = ids.shape
    m = torch.eye(E, dtype=torch.bool, device=ids.device).expand(B, E, E).clone()
    for c in range(E):
        pidx = (ids == parents[:, c:c + 1]).float().argmax(1)
        m[:, c] |= m[torch.arange(B), pidx] & (parents[:, c] >= 0)[:, None]
    return m


def score_of(scores: list[Tensor], ids: Tensor) -> Tensor:
    return torch.cat(scores, 1).gather(1, ids)
