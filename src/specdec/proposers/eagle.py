"""EAGLE proposer: a feature-level draft head growing a dynamic token tree (EAGLE-2 style).

State per sequence: the head's KV cache holds pairs (f_i, x_{i+1}) for every
committed position i, and `pred` is the head's output at the last one (the
predicted feature of the pending token's position). Drafting expands, depth by
depth, the `topk` best nodes by cumulative draft log-probability, each into its
`topk` best children; the `budget` best nodes overall form the tree the target
verifies (topk = 1 drafts a plain chain instead). After verification the accepted path's true target features are fed
back, so drafting always restarts from exact features.
"""
from __future__ import annotations

import math

import torch
from torch import Tensor

from ..models.eagle import EagleHead
from ..tree import TokenTree, TreeVerdict
from ..verify import Draft, Verdict
from .base import ActiveBatch


class EagleProposer:
    name = "eagle"

    def __init__(self, head: EagleHead, topk: int = 4, depth: int = 5, budget: int = 16,
                 min_confidence: float = 0.0) -> None:
        """min_confidence: a chain stops where the head's cumulative probability of its drafts falls
        below it (0 = always draft `depth` tokens); drafts that would rarely be accepted cost
        target compute and head forwards for nothing. Each sequence's chain is cut by its own
        confidence; the batch drafts until every chain has stopped. Trees use `budget` instead."""
        self.head, self.topk, self.depth, self.budget = head, topk, depth, budget
        self.log_min_confidence = math.log(min_confidence) if min_confidence > 0 else -math.inf
        self.pred: dict[int, Tensor] = {}

    def allocate(self, rows: int, slots: int) -> None:
        self.cache = self.head.new_cache(rows, slots + self.topk * self.depth + 2)

    def _feed(self, rows: Tensor, tokens: list[list[int]], feats: list[Tensor]) -> None:
        """Commit pairs (features[i], tokens[i]) after each row's head cache; remember the last output."""
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
        out = self.head(tok, f, base[:, None] + torch.arange(T, device=dev), self.cache, rows)
        self.cache.commit(rows, torch.arange(T, device=dev).expand(B, T), n)
        for i, r in enumerate(rows.tolist()):
            self.pred[r] = out[i, int(n[i]) - 1]

    def start(self, rows: Tensor, prompts: list[list[int]], hidden: Tensor) -> None:
        self.cache.truncate(rows, torch.zeros_like(rows))
        toks = [p[1:] for p in prompts]                           # x_{i+1} for i = 0 .. P-1
        self._feed(rows, toks, [hidden[i, :len(t)] for i, t in enumerate(toks)])

    def commit(self, batch: ActiveBatch, verdict: Verdict | TreeVerdict, hidden: Tensor) -> None:
        rows = batch.rows
        n = verdict.num_new.tolist()
        path = verdict.path
        toks = [verdict.tokens[i, :n[i]].tolist() for i in range(len(n))]
        feats = [hidden[i, path[i, :n[i]]] for i in range(len(n))]
        self._feed(rows, toks, feats)

    @torch.inference_mode()
    def propose(self, batch: ActiveBatch, k: int) -> Draft:
        head, K = self.head, self.topk
        rows = batch.rows
        B = rows.numel()
        dev = head.fc.weight.device
        ids = head.vocab_ids.to(dev)
        base = self.cache.lengths[rows]                            # head positions of the first draft layer
        pred = torch.stack([self.pred[r] for r in rows.tolist()])  # [B, H]
        # every node: token, parent (-1 = root), score, depth; the head output of expanded nodes
        logp = torch.log_softmax(head.logits(pred), -1)            # [B, V']
        s, j = logp.topk(K, -1)
        tok = ids[j]                                               # [B, K]
        score, par, depth = s, torch.full((B, K), -1, device=dev), torch.ones(B, K, dtype=torch.long, device=dev)
        nodes_tok, nodes_par, nodes_score, nodes_depth = [tok], [par], [score], [depth]
        frontier = torch.arange(K, device=dev).expand(B, K)        # node ids to expand (this depth's best)
        exp_ids: list[Tensor] = []                                 # expanded node ids, in feeding order
        exp_feat_src: list[Tensor] = []                            # their input features
        total = K
        outs = pred[:, None]
        for d in range(1, min(self.depth, k)):                     # feed depth-d frontier -> depth d+1 children
            if K == 1 and bool((nodes_score[-1] < self.log_min_confidence).all()):
                break                                              # every chain fell below min_confidence
                                                                   # (each is cut at its own point below)
            all_par = torch.cat(nodes_par, 1)
            if d == 1:
                feat = pred[:, None].expand(B, K, pred.shape[-1])
            else:                                                  # parent's predicted feature
                fpar = all_par.gather(1, frontier)                 # [B, K] parents, all expanded earlier
                slot = (torch.cat(exp_ids, 1)[:, None, :] == fpar[..., None]).float().argmax(-1)
                feat = outs.gather(1, slot[..., None].expand(B, K, outs.shape[-1]))
            exp_ids.append(frontier)
            exp_feat_src.append(feat)
            e_ids = torch.cat(exp_ids, 1)                          # [B, E] every expanded node so far
            e_tok = torch.cat(nodes_tok, 1).gather(1, e_ids)
            e_depth = torch.cat(nodes_depth, 1).gather(1, e_ids)
            e_par = all_par.gather(1, e_ids)
            E = e_ids.shape[1]
            m = torch.eye(E, dtype=torch.bool, device=dev).expand(B, E, E).clone()
            for c in range(E):                                     # ancestors precede descendants
                pidx = (e_ids == e_par[:, c:c + 1]).float().argmax(1)
                m[:, c] |= m[torch.arange(B), pidx] & (e_par[:, c] >= 0)[:, None]
            outs = head(e_tok, torch.cat(exp_feat_src, 1), base[:, None] + e_depth - 1, self.cache, rows, m)
            new = outs[:, -K:]                                     # the frontier's outputs
            lp = torch.log_softmax(head.logits(new), -1)           # [B, K, V']
            cs, cj = lp.topk(K, -1)                                # [B, K, K]
            cscore = (score_of(nodes_score, frontier)[..., None] + cs).view(B, K * K)
            ctok = ids[cj].view(B, K * K)
            cpar = frontier[..., None].expand(B, K, K).reshape(B, K * K)
            nodes_tok.append(ctok)
            nodes_par.append(cpar)
            nodes_score.append(cscore)
            nodes_depth.append(torch.full((B, K * K), d + 1, dtype=torch.long, device=dev))
            best = cscore.topk(K, -1).indices                      # expand the best K children next
            frontier = total + best
            total += K * K
        if K == 1:                     # a chain: verified as one (cheaper than a tree forward), q a point mass
            tokens = torch.cat(nodes_tok, 1)                       # [B, depth], one node per depth in order
            low = torch.cat(nodes_score, 1) < self.log_min_confidence  # cumulative: a suffix of each chain
            return Draft(tokens.masked_fill(low, -1))
        return Draft(torch.zeros(B, 1, dtype=torch.long, device=dev), None,
                     self._select(batch, torch.cat(nodes_tok, 1), torch.cat(nodes_par, 1),
                                  torch.cat(nodes_score, 1), torch.cat(nodes_depth, 1)))

    def _select(self, batch: ActiveBatch, tok: Tensor, par: Tensor, score: Tensor, depth: Tensor) -> TokenTree:
        """The `budget` best nodes (parents before children) as a tree rooted at the pending token."""
        B, M = tok.shape
        n = min(self.budget, M)
        out_tok = torch.full((B, n + 1), -1, dtype=torch.long)
        out_par = torch.full((B, n + 1), -1, dtype=torch.long)
        order = torch.argsort(score - 1e-6 * depth, dim=-1, descending=True).tolist()
        tl, pl = tok.tolist(), par.tolist()
        for b in range(B):
            out_tok[b, 0] = batch.tokens[b][-1]
            where = {}
            for node in order[b]:
                if len(where) == n:
                    break
                p = pl[b][node]
                if p >= 0 and p not in where:
                    continue                                       # its parent did not make the cut
                where[node] = len(where) + 1
                out_tok[b, where[node]] = tl[b][node]
                out_par[b, where[node]] = 0 if p < 0 else where[p]
        dev = tok.device
        return TokenTree(out_tok.to(dev), out_par.to(dev))


def score_of(scores: list[Tensor], ids: Tensor) -> Tensor:
    return torch.cat(scores, 1).gather(1, ids)
