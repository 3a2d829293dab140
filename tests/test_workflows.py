"""Workflow dataflow, token splicing, credit, group keys, metrics and slot routing.

A scripted policy stands in for the sampler: its outputs are chosen per (stage, row) and it records
every prompt it receives, so the tests can check who sees what, in which order, in how many calls.
"""
import dataclasses
import functools
import json
import os
import re
import sys
import types

import pytest

from marl_jax.policy.slots import num_slots, role_to_slot
from marl_jax.tasks.base import Score, Task
from marl_jax.workflows import (Completion, Splice, format_transcript, make_workflow,
                                render_prompt, rows_to_jsonl, run_episodes)
from marl_jax.workflows.base import fill

# ---------------------------------------------------------------------------------------------
# Fakes
# ---------------------------------------------------------------------------------------------


class ByteTok:
    """One token per UTF-8 byte, plus ChatML specials and one merged token "ab" (id 300).

    encode always merges "ab", so a sampler that emits "a","b" as two byte tokens produces a
    tokenisation that re-encoding would NOT reproduce: splicing must keep it.
    """

    SPECIALS = {"<|im_start|>": 256, "<|im_end|>": 257, "<|endoftext|>": 258}
    AB = 300
    eos_token_ids = (257, 258)

    def encode(self, text):
        out = []
        for piece in re.split("(" + "|".join(map(re.escape, self.SPECIALS)) + ")", text):
            if piece in self.SPECIALS:
                out.append(self.SPECIALS[piece])
                continue
            i = 0
            while i < len(piece):
                if piece.startswith("ab", i):
                    out.append(self.AB)
                    i += 2
                else:
                    out.extend(piece[i].encode("utf-8"))
                    i += 1
        return out

    def decode(self, ids, skip_special_tokens=True):
        inv = {v: k for k, v in self.SPECIALS.items()}
        buf, out = bytearray(), []
        for t in ids:
            if t in inv:
                out.append(buf.decode("utf-8", "replace"))
                buf = bytearray()
                if not skip_special_tokens:
                    out.append(inv[t])
            elif t == self.AB:
                buf += b"ab"
            else:
                buf.append(t)
        out.append(buf.decode("utf-8", "replace"))
        return "".join(out)

    def apply_chat_template(self, messages, add_generation_prompt=True, enable_thinking=False):
        s = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
        return s + ("<|im_start|>assistant\n" if add_generation_prompt else "")

    def raw(self, text):
        """Non-canonical tokens for text: bytes only, never the merged "ab"."""
        return list(text.encode("utf-8"))


TOK = ByteTok()


class Script:
    """A sampler whose outputs come from respond(stage, prompt_text, i) and which records calls.

    respond returns a string (finished, stop token appended), or (string, False) for a truncated
    completion. Completion tokens are the raw bytes (non-canonical where "ab" occurs).
    """

    def __init__(self, respond):
        self.respond = respond
        self.calls = []

    def __call__(self, slot, prompts, max_new_tokens, stage):
        texts = [TOK.decode(p, skip_special_tokens=False) for p in prompts]
        self.calls.append(dict(slot=slot, stage=stage, prompts=[list(p) for p in prompts],
                               texts=texts, max_new_tokens=max_new_tokens))
        out = []
        for i, t in enumerate(texts):
            r = self.respond(stage, t, i)
            text, finished = (r, True) if isinstance(r, str) else r
            toks = TOK.raw(text) + ([257] if finished else [])
            out.append(Completion(toks, [-0.5] * len(toks), finished))
        return out

    def stage_calls(self, stage):
        return [c for c in self.calls if c["stage"] == stage]


def boxed_grader(task, text):
    """Test grader: exact match of the last \\boxed{...} content (these tests use plain integers)."""
    found = re.findall(r"\\boxed\{([^{}]*)\}", text)
    return Score(float(bool(found) and found[-1].strip() == task.answer),
                 found[-1] if found else None)


def tid_of(prompt_text):
    """The task id the test questions embed: 'Problem T<k>: ...'."""
    return re.search(r"Problem (T\d+)", prompt_text).group(1)


def math_tasks(n):
    return [Task(f"T{k}", "math", f"Problem T{k}: what is {k} + {k}?", str(2 * k)) for k in range(n)]


def contains(seq, sub):
    """Start index of the contiguous sub-list sub in seq, or -1."""
    n = len(sub)
    for i in range(len(seq) - n + 1):
        if seq[i:i + n] == sub:
            return i
    return -1


RUN = functools.partial(run_episodes, tokenizer=TOK, grade_fn=boxed_grader)

# ---------------------------------------------------------------------------------------------
# Slots
# ---------------------------------------------------------------------------------------------


def test_role_to_slot_shared_and_isolated():
    roles = ["orchestrator", "worker", "worker", "synthesizer"]
    assert role_to_slot(roles, "shared") == {"orchestrator": 0, "worker": 0, "synthesizer": 0}
    assert role_to_slot(roles, "isolated") == {"orchestrator": 0, "worker": 1, "synthesizer": 2}
    assert role_to_slot(roles, "IP") == role_to_slot(roles, "isolated")
    assert num_slots(roles, "shared") == 1 and num_slots(roles, "isolated") == 3
    with pytest.raises(ValueError, match="shared, isolated"):
        role_to_slot(roles, "separate")
    with pytest.raises(ValueError, match="empty"):
        role_to_slot([], "shared")
    with pytest.raises(TypeError):
        role_to_slot("generator", "shared")


@pytest.mark.parametrize("policy,expected", [("shared", {"generate": 0, "aggregate": 0}),
                                             ("isolated", {"generate": 0, "aggregate": 1})])
def test_stages_route_to_role_slots(policy, expected):
    wf = make_workflow("voting")
    s = Script(lambda stage, t, i: r"\boxed{1}")
    res = RUN(wf, math_tasks(2), 2, s, role_to_slot=role_to_slot(wf.roles, policy))
    assert {c["stage"]: c["slot"] for c in s.calls} == expected
    assert all(r.slot == expected[r.stage] for r in res.rows)
    # The string shorthand builds the same mapping.
    s2 = Script(lambda stage, t, i: r"\boxed{1}")
    RUN(wf, math_tasks(2), 2, s2, role_to_slot=policy)
    assert {c["stage"]: c["slot"] for c in s2.calls} == expected


def test_missing_role_in_mapping_is_an_error():
    wf = make_workflow("voting")
    with pytest.raises(ValueError, match="aggregator"):
        RUN(wf, math_tasks(1), 1, Script(lambda *a: "x"), role_to_slot={"generator": 0})

# ---------------------------------------------------------------------------------------------
# Token splicing
# ---------------------------------------------------------------------------------------------


def _row_like(tokens, finished, text):
    return types.SimpleNamespace(completion_tokens=tokens, finished=finished, text=text)


def test_render_prompt_splices_exact_tokens():
    earlier = TOK.raw("abc ab") + [257]                 # non-canonical: "ab" as two bytes
    s = Splice.of(_row_like(earlier, True, "abc ab"))
    assert list(s.tokens) == earlier[:-1]               # stop token stripped
    msgs = (("system", ("Be brief.",)), ("user", ("Check: ", s, " -- ok?")))
    toks, text = render_prompt(TOK, msgs)
    assert contains(toks, earlier[:-1]) >= 0
    assert contains(toks, earlier) == -1                # the stop token is not spliced
    # Everything around the splice is the canonical encoding of the rendered template text.
    i = contains(toks, earlier[:-1])
    rendered = TOK.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Check: abc ab -- ok?"}])
    pre, post = rendered.split("abc ab")
    assert toks[:i] == TOK.encode(pre) and toks[i + len(earlier) - 1:] == TOK.encode(post)
    assert text == rendered and TOK.decode(toks, skip_special_tokens=False) == rendered
    # Re-encoding the text would have merged "ab": splicing is what kept the sampled tokens.
    assert TOK.encode(rendered) != toks


def test_unfinished_completion_is_spliced_whole():
    cut = TOK.raw("ab trunc")
    s = Splice.of(_row_like(cut, False, "ab trunc"))
    assert list(s.tokens) == cut
    toks, _ = render_prompt(TOK, (("user", ("x", s, "y")),))
    assert toks == TOK.encode("<|im_start|>user\nx") + cut + TOK.encode("y<|im_end|>\n<|im_start|>assistant\n")


def test_render_prompt_rejects_template_that_drops_content():
    class Dropper(ByteTok):
        def apply_chat_template(self, messages, **kw):
            return "fixed prompt"
    with pytest.raises(RuntimeError, match="placeholders"):
        render_prompt(Dropper(), (("user", ("a", Splice((1, 2), "zz"))),))


def test_fill_fields_and_errors():
    parts = fill(r"Q: {{q}} \boxed{} {{s}}{{n}}", q="why", s=Splice((5,), "five"), n=3)
    assert parts == ["Q: ", "why", r" \boxed{} ", Splice((5,), "five"), "3"]
    with pytest.raises(KeyError, match="missing"):
        fill("{{missing}}", q="x")


def test_later_prompts_hold_earlier_completion_tokens_exactly():
    # Voters emit outputs with "ab" as separate bytes; the aggregator prompt must contain those exact
    # token lists (minus the stop token), in vote order.
    wf = make_workflow("voting", n_votes=3)

    def respond(stage, t, i):
        return f"vote {i} about abacus \\boxed{{{i}}}" if stage == "generate" else r"\boxed{1}"
    s = Script(respond)
    res = RUN(wf, math_tasks(1), 1, s, role_to_slot="shared")
    gens = [r for r in res.rows if r.role == "generator"]
    agg = [r for r in res.rows if r.role == "aggregator"][0]
    starts = [contains(agg.prompt_tokens, g.completion_tokens[:-1]) for g in gens]
    assert all(x >= 0 for x in starts) and starts == sorted(starts)
    assert all(g.completion_tokens[-1] == 257 for g in gens)
    assert all(contains(agg.prompt_tokens, g.completion_tokens) == -1 for g in gens)
    # The row's prompt tokens are exactly what the sampler was given.
    assert s.stage_calls("aggregate")[0]["prompts"][0] == agg.prompt_tokens


def test_splicing_with_a_real_chat_template_tokenizer():
    import transformers

    from marl_jax.models.embedded import embedded_gguf_path

    path = embedded_gguf_path("smollm2-135m-instruct")  # raises with the pip command when missing
    hf = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)

    class HFTok:
        eos_token_ids = (hf.eos_token_id,)

        def encode(self, text):
            return hf.encode(text, add_special_tokens=False)

        def decode(self, ids, skip_special_tokens=True):
            return hf.decode(ids, skip_special_tokens=skip_special_tokens)

        def apply_chat_template(self, messages, add_generation_prompt=True, enable_thinking=False):
            return hf.apply_chat_template(messages, tokenize=False,
                                          add_generation_prompt=add_generation_prompt)

    tok = HFTok()
    msgs = [{"role": "system", "content": "You check work."},
            {"role": "user", "content": "What is 2+3? Think, then answer."}]
    ours, _ = render_prompt(tok, tuple((m["role"], (m["content"],)) for m in msgs))
    theirs = hf.apply_chat_template(msgs, tokenize=True, add_generation_prompt=True)
    theirs = theirs["input_ids"] if isinstance(theirs, dict) or hasattr(theirs, "keys") else theirs
    assert ours == list(theirs)
    sampled = hf.encode(" 2 plus 3 is 5", add_special_tokens=False) + [hf.eos_token_id]
    s = Splice.of(_row_like(sampled, True, " 2 plus 3 is 5"))
    toks, text = render_prompt(tok, (("user", ("Answer was:", s, "\nIs it right?")),))
    i = contains(toks, sampled[:-1])
    assert i >= 0 and toks[i + len(sampled) - 1] != hf.eos_token_id
    assert hf.decode(toks) == text

# ---------------------------------------------------------------------------------------------
# Single agent
# ---------------------------------------------------------------------------------------------


def test_single_agent():
    wf = make_workflow("single_agent")
    # T0's answer is 0, T1's is 2. Episode g of T1 answers right only for g == 0.
    def respond(stage, t, i):
        return r"\boxed{2}" if i == 2 else r"\boxed{9}"
    s = Script(respond)
    res = RUN(wf, math_tasks(2), 2, s, role_to_slot="shared", max_new_tokens=77)
    assert len(s.calls) == 1 and s.calls[0]["stage"] == "generate"
    assert s.calls[0]["max_new_tokens"] == 77 and len(s.calls[0]["prompts"]) == 4
    assert [tid_of(t) for t in s.calls[0]["texts"]] == ["T0", "T0", "T1", "T1"]
    assert [e.success for e in res.episodes] == [0.0, 0.0, 1.0, 0.0]
    assert [r.reward for r in res.rows] == [0.0, 0.0, 1.0, 0.0]
    assert [r.group_key for r in res.rows] == [("T0", "generator")] * 2 + [("T1", "generator")] * 2
    assert [e.episode_id for e in res.episodes] == [0, 1, 2, 3]
    assert [e.episode_index for e in res.episodes] == [0, 1, 0, 1]
    m = res.metrics
    assert m["success"] == 0.25 and m["generator/accuracy"] == 0.25
    assert (m["solve_none"], m["solve_all"], m["solve_partial"]) == (0.5, 0.0, 0.5)
    assert set(res.timing) >= {"sampler_s", "glue_s", "reward_s", "total_s"}

# ---------------------------------------------------------------------------------------------
# Voting
# ---------------------------------------------------------------------------------------------


def _voting_script(answers, picks):
    """answers[(task_id, episode_index, vote)] -> boxed answer; picks[(task_id, g)] -> aggregator text."""
    counter = {}

    def respond(stage, t, i):
        tid = tid_of(t)
        if stage == "generate":
            n = counter.setdefault((stage, tid), 0)
            counter[(stage, tid)] = n + 1
            g, k = divmod(n, 3)
            return f"Solution by voter {k} of episode {g}: \\boxed{{{answers[(tid, g, k)]}}}"
        n = counter.setdefault((stage, tid), 0)
        counter[(stage, tid)] = n + 1
        return picks[(tid, n)]
    return respond


def test_voting_dataflow_credit_and_groups():
    wf = make_workflow("voting")
    tasks = math_tasks(2)  # answers "0" and "2"
    answers = {("T0", 0, 0): 5, ("T0", 0, 1): 0, ("T0", 0, 2): 0,
               ("T0", 1, 0): 7, ("T0", 1, 1): 8, ("T0", 1, 2): 9,
               ("T1", 0, 0): 2, ("T1", 0, 1): 3, ("T1", 0, 2): 2,
               ("T1", 1, 0): 1, ("T1", 1, 1): 2, ("T1", 1, 2): 4}
    picks = {("T0", 0): r"Voter 2 is right: \boxed{2}",     # correct pick
             ("T0", 1): "I like the 3rd one",              # digit fallback -> 3 (wrong, none right)
             ("T1", 0): r"\boxed{2}",                       # wrong pick though 1 and 3 were right
             ("T1", 1): "no idea"}                          # default -> solution 1 (wrong)
    s = Script(_voting_script(answers, picks))
    res = RUN(wf, tasks, 2, s, role_to_slot="isolated")

    # One sampler call per stage: 2 tasks x 2 episodes x 3 votes, then 4 aggregator calls.
    assert [(c["stage"], len(c["prompts"])) for c in s.calls] == [("generate", 12), ("aggregate", 4)]
    gen_texts = s.stage_calls("generate")[0]["texts"]
    assert len(set(gen_texts[:6])) == 1 and len(set(gen_texts[6:])) == 1  # identical prompt per task
    assert "Problem T0" in gen_texts[0] and "Problem T1" in gen_texts[6]

    # The aggregator sees the problem and the 3 solutions, numbered 1..3 in call order.
    for e, agg_text in zip(res.episodes, s.stage_calls("aggregate")[0]["texts"]):
        assert e.task.question in agg_text
        gens = [r for r in e.rows if r.role == "generator"]
        pos = [agg_text.index(f"Solution {k + 1} ---\n{g.text}") for k, g in enumerate(gens)]
        assert pos == sorted(pos)

    sel = [e.outcomes["selection"] for e in res.episodes]
    how = [e.outcomes["selection_method"] for e in res.episodes]
    assert sel == [2, 3, 2, 1] and how == ["boxed", "digit", "boxed", "default"]
    for e in res.episodes:  # the final answer is the selected generator's output
        gens = [r for r in e.rows if r.role == "generator"]
        assert e.final_text == gens[e.outcomes["selection"] - 1].text
    assert [e.success for e in res.episodes] == [1.0, 0.0, 0.0, 0.0]
    assert [e.outcomes["any_correct"] for e in res.episodes] == [1.0, 0.0, 1.0, 1.0]

    # Broadcast: every row of an episode carries its final 0/1 (4 rows per episode).
    assert [r.reward for r in res.rows] == [1.0] * 4 + [0.0] * 12
    # Math default: voters keyed by call index, 3 groups of 2 per task; aggregator alone.
    keys = [r.group_key for r in res.rows[:4]]
    assert keys == [("T0", "generator", 0), ("T0", "generator", 1), ("T0", "generator", 2),
                    ("T0", "aggregator", 0)]
    assert [r.call_index for r in res.rows[:4]] == [0, 1, 2, 0]

    # Metrics, counted by hand from the tables above.
    gen_right = [0, 1, 1, 0, 0, 0, 1, 0, 1, 0, 1, 0]
    assert res.metrics["generator/accuracy"] == pytest.approx(sum(gen_right) / 12)
    assert res.metrics["aggregator/accuracy"] == 0.25 == res.metrics["success"]
    assert res.metrics["any_correct"] == 0.75
    assert res.metrics["generator/calls"] == 3 and res.metrics["aggregator/calls"] == 1

    # Per-agent credit: generators their own correctness, aggregator its pick's.
    s = Script(_voting_script(answers, picks))
    res = RUN(wf, tasks, 2, s, role_to_slot="isolated", credit="per_agent",
              group_by_call_index=False)
    rewards = [[r.reward for r in e.rows] for e in res.episodes]
    assert rewards == [[0, 1, 1, 1], [0, 0, 0, 0], [1, 0, 1, 0], [0, 1, 0, 0]]
    assert all(r.trained for r in res.rows)
    assert res.rows[0].group_key == ("T0", "generator") == res.rows[2].group_key


def test_voting_groups_pool_voters_on_code():
    wf = make_workflow("voting", n_votes=2)
    tasks = [Task("C1", "code", "Problem T1: print 1", "tests")]
    s = Script(lambda stage, t, i: "```python\nprint(1)\n```" if stage == "generate" else r"\boxed{2}")
    res = RUN(wf, tasks, 2, s, role_to_slot="shared", grade_fn=lambda t, x: Score(1.0))
    assert {r.group_key for r in res.rows if r.role == "generator"} == {("C1", "generator")}
    # The code prompts ask for a fenced python block; the math ones for a box.
    assert "```python" in s.calls[0]["texts"][0]
    assert r"\boxed{}" in RUN(wf, math_tasks(1), 1, Script(lambda *a: "x"), role_to_slot="shared"
                              ).rows[0].prompt_text

# ---------------------------------------------------------------------------------------------
# Eval-Opt
# ---------------------------------------------------------------------------------------------


def _eval_script(plan):
    """plan[task_id] = list of (generator output, evaluator output) per round."""
    counter = {}

    def respond(stage, t, i):
        tid = tid_of(t)
        r = int(stage.rsplit("_", 1)[1])
        gen, ev = plan[tid][r]
        return gen if stage.startswith("generate") else ev
    return respond


def test_eval_opt_early_stop_revision_and_credit():
    wf = make_workflow("eval_opt", max_iterations=3)
    tasks = math_tasks(3)  # answers 0, 2, 4
    plan = {
        # T0: right first time, evaluator agrees -> stops after 1 round.
        "T0": [(r"first try \boxed{0}", r"Looks good. \boxed{Correct}")],
        # T1: wrong, evaluator says Incorrect; then right, evaluator wrongly says Incorrect again
        # (no verdict at all); then wrong, evaluator wrongly says Correct -> 3 rounds.
        "T1": [(r"attempt A \boxed{1}", r"Step 2 is off. \boxed{Incorrect}"),
               (r"attempt B \boxed{2}", "I am unsure."),
               (r"attempt C \boxed{3}", r"\boxed{Correct}")],
        # T2: wrong, Incorrect; right, Correct -> 2 rounds.
        "T2": [(r"guess \boxed{5}", r"\boxed{Incorrect}"),
               (r"better \boxed{4}", r"\boxed{Correct}")],
    }
    s = Script(_eval_script(plan))
    res = RUN(wf, tasks, 1, s, role_to_slot="isolated",
              max_new_tokens={"generator": 50, "evaluator": 30})
    # One call per stage that has work; active episodes shrink as they stop.
    assert [(c["stage"], len(c["prompts"]), c["slot"], c["max_new_tokens"]) for c in s.calls] == [
        ("generate_0", 3, 0, 50), ("evaluate_0", 3, 1, 30),
        ("generate_1", 2, 0, 50), ("evaluate_1", 2, 1, 30),
        ("generate_2", 1, 0, 50), ("evaluate_2", 1, 1, 30)]
    e0, e1, e2 = res.episodes
    assert [r.role for r in e1.rows] == ["generator", "evaluator"] * 3
    assert [e.outcomes["iterations"] for e in res.episodes] == [1, 3, 2]
    assert e1.outcomes["verdicts"] == ["Incorrect", None, "Correct"]
    # The final answer is the last generator output, whatever the evaluator said.
    assert e1.final_text == r"attempt C \boxed{3}" and e1.success == 0.0
    assert e2.final_text == r"better \boxed{4}" and e2.success == 1.0 and e0.success == 1.0

    # The evaluator sees the whole conversation; the reviser sees the critique.
    ev_last = s.stage_calls("evaluate_2")[0]["texts"][0]
    order = ["Problem T1", "attempt A", "Step 2 is off.", "attempt B", "I am unsure.", "attempt C"]
    pos = [ev_last.index(x) for x in order]
    assert pos == sorted(pos)
    gen_1 = s.stage_calls("generate_1")[0]["texts"]
    t1_rev = next(t for t in gen_1 if "Problem T1" in t)
    assert "attempt A" in t1_rev and "Step 2 is off." in t1_rev and "attempt B" not in t1_rev
    assert "different approach" in t1_rev

    # Broadcast credit.
    assert [r.reward for r in e1.rows] == [0.0] * 6 and [r.reward for r in e2.rows] == [1.0] * 4
    assert {r.group_key for r in e1.rows} == {("T1", "generator"), ("T1", "evaluator")}
    # Per-agent: generator turns own correctness; evaluator turns 1 iff verdict matches.
    s = Script(_eval_script(plan))
    res = RUN(wf, tasks, 1, s, role_to_slot="shared", credit="per_agent", group_by_call_index=True)
    e0, e1, e2 = res.episodes
    assert [r.reward for r in e0.rows] == [1, 1]
    assert [r.reward for r in e1.rows] == [0, 1, 1, 0, 0, 0]   # B right + "unsure" = mismatch
    assert [r.reward for r in e2.rows] == [0, 1, 1, 1]
    assert [r.group_key for r in e1.rows][:4] == [("T1", "generator", 0), ("T1", "evaluator", 0),
                                                   ("T1", "generator", 1), ("T1", "evaluator", 1)]
    # Hand-counted: generator right 1/1, 1/3, 1/2 -> 3/6; evaluator matches 1 + 1 + 2 of 6.
    assert res.metrics["generator/accuracy"] == 0.5
    assert res.metrics["evaluator/accuracy"] == pytest.approx(4 / 6)
    assert res.metrics["iterations"] == 2.0


def test_eval_opt_default_rounds_per_kind():
    wf = make_workflow("eval_opt")
    s = Script(lambda stage, t, i: r"\boxed{Incorrect}" if stage.startswith("evaluate") else "x")
    res = RUN(wf, [Task("C0", "code", "Problem T0: code", None)], 1, s, role_to_slot="shared",
              grade_fn=lambda t, x: Score(0.0))
    assert [c["stage"] for c in s.calls] == ["generate_0", "evaluate_0", "generate_1", "evaluate_1"]
    s = Script(lambda stage, t, i: "no verdict here")
    res = RUN(wf, math_tasks(1), 1, s, role_to_slot="shared")
    assert len(s.calls) == 6 and res.episodes[0].outcomes["iterations"] == 3


def _chat_extends(rows):
    """Each row's prompt starts with the previous row's prompt + completion, token for token."""
    return all(b.prompt_tokens[:len(a.prompt_tokens) + len(a.completion_tokens)]
               == a.prompt_tokens + a.completion_tokens for a, b in zip(rows, rows[1:]))


_T1_PLAN = {"T1": [(r"attempt A \boxed{1}", r"Step 2 is off. \boxed{Incorrect}"),
                   (r"attempt B ab \boxed{5}", "I am unsure."),
                   (r"attempt C \boxed{2}", r"\boxed{Correct}")]}


def test_eval_opt_chat_prompts_extend_each_roles_previous_call():
    tasks = [math_tasks(2)[1]]
    quoted, chat = Script(_eval_script(_T1_PLAN)), Script(_eval_script(_T1_PLAN))
    rq = RUN(make_workflow("eval_opt", max_iterations=3), tasks, 1, quoted, role_to_slot="shared")
    rc = RUN(make_workflow("eval_opt", max_iterations=3, conversation="chat"), tasks, 1, chat,
             role_to_slot="shared")
    gens = [r for r in rc.rows if r.role == "generator"]
    evals = [r for r in rc.rows if r.role == "evaluator"]
    assert len(gens) == len(evals) == 3
    # Same dataflow, outcomes and credit as the quoted form; only the prompts' layout differs.
    assert [(c["stage"], len(c["prompts"])) for c in chat.calls] == [
        (c["stage"], len(c["prompts"])) for c in quoted.calls]
    assert rc.episodes[0].outcomes == rq.episodes[0].outcomes
    assert [r.reward for r in rc.rows] == [r.reward for r in rq.rows]
    # Each role's chat grows: its previous prompt + completion (stop token included, "ab" as sampled
    # bytes) starts its next prompt, so a prefix cache can load all of it.
    assert _chat_extends(gens) and _chat_extends(evals)
    assert not _chat_extends([r for r in rq.rows if r.role == "generator"])
    # Who sees what: the reviser sees the review after its own attempt; the evaluator its own review,
    # then the new attempt.
    g1 = chat.stage_calls("generate_1")[0]["texts"][0]
    order = ["Problem T1", "attempt A", "<|im_start|>user\n=== Review of attempt 1", "Step 2 is off.",
             "different approach"]
    assert [g1.index(x) for x in order] == sorted(g1.index(x) for x in order)
    e2 = chat.stage_calls("evaluate_2")[0]["texts"][0]
    order = ["Problem T1", "attempt A", "Step 2 is off.", "attempt B", "I am unsure.", "attempt C"]
    assert [e2.index(x) for x in order] == sorted(e2.index(x) for x in order)
    assert e2.count("<|im_start|>assistant") == 3  # two past reviews + the generation prompt
    with pytest.raises(ValueError, match="conversation must be one of"):
        make_workflow("eval_opt", conversation="threaded")


def test_eval_opt_chat_prompts_extend_with_the_real_chat_template(smollm):
    """With SmolLM2's own tokenizer and chat template, on every packaged prompt set."""
    tok = smollm.tokenizer

    class Sampled:
        def __init__(self):
            self.calls = []

        def __call__(self, slot, prompts, max_new_tokens, stage):
            self.calls.append(stage)
            text = r"It is \boxed{Incorrect}" if stage.startswith("evaluate") else "x = 2 + 2 = 4"
            toks = tok.encode(text) + [tok.eos_token_ids[0]]
            return [Completion(toks, [-0.5] * len(toks), True) for _ in prompts]

    for prompt_dir, task in (("", math_tasks(1)[0]), ("compact", math_tasks(1)[0]),
                             ("", Task("C0", "code", "Problem C0: print 4", None))):
        wf = make_workflow("eval_opt", conversation="chat", prompt_dir=prompt_dir)
        res = run_episodes(wf, [task], 1, Sampled(), tokenizer=tok, role_to_slot="shared",
                           grade_fn=lambda t, x: Score(0.0))
        for role in ("generator", "evaluator"):
            rows = [r for r in res.rows if r.role == role]
            assert len(rows) == wf.iterations_for(task.kind) and _chat_extends(rows), (prompt_dir, role)

# ---------------------------------------------------------------------------------------------
# Orchestrator-Workers
# ---------------------------------------------------------------------------------------------


def _orch_script(orch_text):
    def respond(stage, t, i):
        if stage == "orchestrate":
            return orch_text
        if stage == "work":
            return f"worker {i % 3} done \\boxed{{{i % 3}}}"  # i % 3: item index when 3 items
        return r"combined: \boxed{0}"
    return respond


def test_orch_workers_strategies_dataflow():
    wf = make_workflow("orch_workers")
    orch = "STRATEGY 1: try algebra\nSTRATEGY 2: try a table\nSTRATEGY 3: guess\nSTRATEGY 4: extra"
    s = Script(_orch_script(orch))
    res = RUN(wf, math_tasks(1), 2, s, role_to_slot="isolated")
    # 1 orchestrator call per episode, 3 workers (truncated from 4), 1 synthesizer.
    assert [(c["stage"], len(c["prompts"]), c["slot"]) for c in s.calls] == [
        ("orchestrate", 2, 0), ("work", 6, 1), ("synthesize", 2, 2)]
    work = s.stage_calls("work")[0]["texts"]
    assert all("Problem T0" in t for t in work)            # strategy workers see the full problem
    assert ["try algebra" in work[0], "try a table" in work[1], "guess" in work[2]] == [True] * 3
    assert not any("extra" in t for t in work)
    syn = s.stage_calls("synthesize")[0]["texts"][0]
    order = ["Problem T0", "try algebra", "worker 0 done", "try a table", "worker 1 done",
             "guess", "worker 2 done"]
    assert [syn.index(x) for x in order] == sorted(syn.index(x) for x in order)
    e = res.episodes[0]
    assert e.final_text == r"combined: \boxed{0}" and e.success == 1.0
    assert e.outcomes["items"] == 3 and e.outcomes["calls"] == {"orchestrator": 1, "worker": 3,
                                                                 "synthesizer": 1}
    assert e.rows[0].info["items"] == ["try algebra", "try a table", "guess"]
    assert [r.call_index for r in e.rows] == [0, 0, 1, 2, 0]
    # Worker 0 of each episode answered 0 (right): worker accuracy 1/3.
    assert res.metrics["worker/accuracy"] == pytest.approx(1 / 3)
    assert res.metrics["items"] == 3 and res.metrics["worker/calls"] == 3

    # Broadcast: all 5 rows get the final reward.
    assert [r.reward for r in e.rows] == [1.0] * 5 and all(r.trained for r in e.rows)
    # Per-agent: only the synthesizer is credited; the others are marked not trained.
    s = Script(_orch_script(orch))
    res = RUN(wf, math_tasks(1), 2, s, role_to_slot="shared", credit="per_agent")
    e = res.episodes[0]
    assert [(r.role, r.reward, r.trained) for r in e.rows] == [
        ("orchestrator", 0.0, False), ("worker", 0.0, False), ("worker", 0.0, False),
        ("worker", 0.0, False), ("synthesizer", 1.0, True)]


def test_orch_workers_decompose_workers_do_not_see_problem():
    wf = make_workflow("orch_workers", variant="decompose", max_items=3)
    s = Script(_orch_script("Plan:\n1. add the two numbers\n2. double check the sum"))
    res = RUN(wf, math_tasks(2), 1, s, role_to_slot="shared")
    work = s.stage_calls("work")[0]["texts"]
    assert len(work) == 4                                   # 2 items x 2 episodes
    assert not any("Problem T" in t for t in work)
    assert "add the two numbers" in work[0] and "double check the sum" in work[1]
    syn = s.stage_calls("synthesize")[0]["texts"]
    assert "Problem T0" in syn[0] and "worker 1 done" in syn[0] and "Subtask 2" in syn[0]
    assert res.episodes[0].outcomes["items_method"] == "numbered"
    # Decompose workers are not graded (they do not answer the task).
    assert all(r.score is None for r in res.rows if r.role == "worker")


def test_orch_workers_whole_output_is_one_item():
    wf = make_workflow("orch_workers", max_items=3)
    s = Script(_orch_script("do it"))
    res = RUN(wf, math_tasks(1), 1, s, role_to_slot="shared")
    assert len(s.stage_calls("work")[0]["prompts"]) == 1
    assert res.episodes[0].rows[0].info == {"items": ["do it"], "items_method": "whole"}

# ---------------------------------------------------------------------------------------------
# Output, registry, errors
# ---------------------------------------------------------------------------------------------


def test_transcript_and_jsonl(tmp_path):
    wf = make_workflow("eval_opt", max_iterations=2)
    s = Script(lambda stage, t, i: r"\boxed{Incorrect}" if stage.startswith("evaluate")
               else (r"try \boxed{0}", False))   # truncated generator outputs
    res = RUN(wf, math_tasks(1), 1, s, role_to_slot="isolated")
    out = format_transcript(res.episodes[0])
    for needle in ["[generate_0] generator call 0", "[evaluate_1] evaluator call 1", "Problem T0",
                   '"verdict": "Incorrect"', "truncated", "<- final answer",
                   "('T0', 'evaluator')", "final: reward 1"]:
        assert needle in out, needle
    path = tmp_path / "rows.jsonl"
    rows_to_jsonl(res.rows, str(path))
    recs = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(recs) == 4
    assert recs[1]["group_key"] == ["T0", "evaluator"] and recs[1]["info"]["verdict"] == "Incorrect"
    assert recs[0]["completion_tokens"] == res.rows[0].completion_tokens
    assert recs[0]["finished"] is False and recs[0]["score"]["reward"] == 1.0
    # An unfinished completion has no stop token to strip; it is quoted whole.
    assert contains(res.rows[1].prompt_tokens, res.rows[0].completion_tokens) >= 0


def test_make_workflow_errors():
    with pytest.raises(ValueError, match="single_agent, eval_opt, voting, orch_workers"):
        make_workflow("debate")
    with pytest.raises(ValueError, match="n_votes"):
        make_workflow("voting", n_vote=3)
    with pytest.raises(ValueError, match="variant"):
        make_workflow("orch_workers", variant="tree")
    with pytest.raises(ValueError, match="1..9"):
        make_workflow("voting", n_votes=12)
    with pytest.raises(ValueError, match="max_iterations"):
        make_workflow("eval_opt", max_iterations=0)


def test_run_episodes_input_errors():
    wf = make_workflow("single_agent")
    ok = Script(lambda *a: "x")
    with pytest.raises(ValueError, match="credit"):
        RUN(wf, math_tasks(1), 1, ok, role_to_slot="shared", credit="team")
    with pytest.raises(ValueError, match="max_new_tokens"):
        RUN(make_workflow("voting"), math_tasks(1), 1, ok, role_to_slot="shared",
            max_new_tokens={"generator": 5})

    def short(slot, prompts, n, stage):
        return [Completion([1], [0.0], False)]
    with pytest.raises(ValueError, match="2 prompts"):
        RUN(wf, math_tasks(2), 1, short, role_to_slot="shared")

    def bad(slot, prompts, n, stage):
        return [Completion([1, 2], [0.0], True) for _ in prompts]
    with pytest.raises(ValueError, match="logprobs"):
        RUN(wf, math_tasks(1), 1, bad, role_to_slot="shared")


def test_every_workflow_runs_on_both_kinds_with_packaged_prompts():
    # Catches a missing template or field in prompts/math.json and prompts/code.json.
    for name, cfg in [("single_agent", {}), ("eval_opt", {}), ("voting", {}),
                      ("orch_workers", {}), ("orch_workers", {"variant": "decompose"})]:
        for kind in ("math", "code"):
            wf = make_workflow(name, **cfg)
            s = Script(lambda stage, t, i: "STRATEGY 1: a long enough plan" if stage == "orchestrate" else "y")
            res = RUN(wf, [Task("K", kind, "Problem T9: q", "1")], 1, s, role_to_slot="isolated",
                      grade_fn=lambda t, x: Score(0.0))
            assert res.rows and all(r.prompt_text.startswith("<|im_start|>system\n") for r in res.rows)
            assert len(s.calls) == len(wf.plan([Task("K", kind, "q", "1")]))

# ---------------------------------------------------------------------------------------------
# Grading dispatch
# ---------------------------------------------------------------------------------------------


def test_grade_dispatches_on_kind(monkeypatch):
    from marl_jax.tasks import grading
    seen = []
    fake_math = types.ModuleType("marl_jax.tasks.math")
    fake_math.score = lambda text, answer, mode="boxed": seen.append(("math", text, answer, mode)) or Score(1.0)
    fake_code = types.ModuleType("marl_jax.tasks.code")
    fake_code.score = lambda text, tests, timeout_s=3.0: seen.append(("code", text, tests, timeout_s)) or Score(0.0)
    monkeypatch.setitem(sys.modules, "marl_jax.tasks.math", fake_math)
    monkeypatch.setitem(sys.modules, "marl_jax.tasks.code", fake_code)
    m = Task("m", "math", "q", "42")
    c = Task("c", "code", "q", {"tests": []})
    assert grading.grade(m, "t1", math_mode="last_number").reward == 1.0
    assert grading.grade(c, "t2", code_timeout_s=1.5).reward == 0.0
    assert seen == [("math", "t1", "42", "last_number"), ("code", "t2", {"tests": []}, 1.5)]
    with pytest.raises(ValueError, match="math, code"):
        grading.grade(Task("x", "poem", "q", None), "t")
    seen.clear()
    out = grading.grade_many([c, m, c, m], ["a", "b", "c", "d"], max_workers=2, math_mode="boxed")
    assert [s.reward for s in out] == [0.0, 1.0, 0.0, 1.0]
    assert sorted(x[1] for x in seen) == ["a", "b", "c", "d"]
    with pytest.raises(ValueError, match="not both"):
        grading.grade_many([m], ["x"], grade_fn=grading.grade, math_mode="boxed")


def test_grade_many_runs_code_in_threads(monkeypatch):
    import threading
    from marl_jax.tasks import grading
    barrier = threading.Barrier(3, timeout=10)   # passes only if 3 code gradings run at once

    def fn(task, text):
        if task.kind == "code":
            barrier.wait()
        return Score(1.0 if task.kind == "code" else 0.5)
    tasks = [Task(str(i), "code", "q", None) for i in range(3)] + [Task("m", "math", "q", "1")]
    out = grading.grade_many(tasks, ["x"] * 4, grade_fn=fn, max_workers=4)
    assert [s.reward for s in out] == [1.0, 1.0, 1.0, 0.5]


def test_real_math_grading_in_a_rollout():
    import marl_jax.tasks.math as math_mod
    wf = make_workflow("voting")
    tasks = [Task("T0", "math", "Problem T0: 1/2 + 1/4?", "3/4")]
    outs = [r"\boxed{0.75}", r"\boxed{\frac{3}{4}}", r"\boxed{1/3}"]
    s = Script(lambda stage, t, i: outs[i] if stage == "generate" else r"\boxed{3}")
    res = run_episodes(wf, tasks, 1, s, TOK, role_to_slot="shared")  # default grade_fn
    assert res.episodes[0].outcomes["generator_correct"] == [1.0, 1.0, 0.0]
    assert res.episodes[0].success == 0.0


def test_array_completions_are_stored_as_python_numbers(tmp_path):
    np = pytest.importorskip("numpy")

    def sample(slot, prompts, n, stage):
        toks = TOK.raw(r"\boxed{0}") + [257]
        return [Completion(np.asarray(toks, np.int32), np.full(len(toks), -0.25, np.float32), True)
                for _ in prompts]
    res = RUN(make_workflow("single_agent"), math_tasks(1), 2, sample, role_to_slot="shared")
    r = res.rows[0]
    assert type(r.completion_tokens[0]) is int and type(r.logprobs[0]) is float
    assert r.text == r"\boxed{0}" and res.metrics["success"] == 1.0
    rows_to_jsonl(res.rows, str(tmp_path / "r.jsonl"))
    assert json.loads((tmp_path / "r.jsonl").read_text().splitlines()[0])["completion_tokens"][-1] == 257
