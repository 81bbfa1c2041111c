import sys, requests, json, openai
P = int(sys.argv[1]); B = f"http://127.0.0.1:{P}/v1"
c = openai.OpenAI(base_url=B, api_key="x")
# n greedy: choices identical; with per-request eagle3
r = c.completions.create(model="smollm2-135m", prompt="def add(a, b):", max_tokens=20, temperature=0, n=3, logprobs=2, extra_body={"speculative":{"method":"eagle3"}})
print("greedy n identical:", len({json.dumps(ch.model_dump()|{"index":0}) for ch in r.choices}) == 1, [ch.model_extra.get("speculative",{}).get("method") for ch in r.choices], r.model_extra["speculative"]["method"])
# chat stream with n and stop
chunks = list(c.chat.completions.create(model="smollm2-135m", messages=[{"role":"user","content":"List three colors"}], max_tokens=40, temperature=0.8, seed=2, n=3, stop=["\n"], logprobs=True, stream=True, stream_options={"include_usage": True}))
rr = c.chat.completions.create(model="smollm2-135m", messages=[{"role":"user","content":"List three colors"}], max_tokens=40, temperature=0.8, seed=2, n=3, stop=["\n"], logprobs=True)
for ch in rr.choices:
    t = "".join(cc.delta.content or "" for x in chunks for cc in x.choices if cc.index == ch.index)
    lp = [e.model_dump() for x in chunks for cc in x.choices if cc.index == ch.index and cc.logprobs and cc.logprobs.content for e in cc.logprobs.content]
    fr = [cc.finish_reason for x in chunks for cc in x.choices if cc.index == ch.index and cc.finish_reason]
    roles = [cc.delta.role for x in chunks for cc in x.choices if cc.index == ch.index and cc.delta.role]
    print(ch.index, repr(ch.message.content), ch.finish_reason, t == ch.message.content, lp == [e.model_dump() for e in ch.logprobs.content], fr, roles, len(lp))
u = [x.usage for x in chunks if x.usage]
print("usage stream", u[0].completion_tokens, "nonstream", rr.usage.completion_tokens, "sum entries", sum(len(ch.logprobs.content) for ch in rr.choices))
print("top_logprobs empty list when not asked:", rr.choices[0].logprobs.content[0].top_logprobs)
