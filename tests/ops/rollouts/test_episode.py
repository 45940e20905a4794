"""Multi-turn rollouts (ops/rollouts/episode.py): exact trajectories, KV kept across turns, the loss
mask, environments that fail, and the phases of a run (each turn's prefill and decode, each
wait on the environments).

The op-test model has random weights and rarely says EOS, so the tests end turns on a token
it says often: ``turn_tokenizer`` is the tokenizer with that token as its EOS (the loop ends
a turn on whatever the tokenizer calls EOS)."""

from __future__ import annotations

import copy
from collections import Counter

import pyarrow as pa
import pytest
import torch
from episode_envs import LOG

from rlhfless.ops.algo.update import UpdateParams, update_policy
from rlhfless.ops.engine import phases
from rlhfless.ops.engine.backend import HFBackend
from rlhfless.ops.engine.engine_types import SamplingParams
from rlhfless.ops.engine.forward import response_logprobs
from rlhfless.ops.engine.generate import decode
from rlhfless.ops.rollouts.episode import EpisodeParams, run_episodes, score_episodes

TEXTS = ["Count the items one by one, then give the total.\nItems: fig pear\nAnswer:",
         "Items: plum\nAnswer:", "Count: kiwi lime lemon mango\nAnswer:",
         "Items: rose lily leaf root stem\nAnswer:"]


@pytest.fixture(scope="module")
def turn_tokenizer(model64, tokenizer, make_prompts):
    """The tokenizer with the token the model says most often (greedy) as EOS."""
    ids = make_prompts(TEXTS).column("prompt_ids").to_pylist()
    said = decode(model64, ids, 1, SamplingParams(24, greedy=True), -1, tokenizer.pad_token_id)
    common = Counter(t for tokens, _, _ in said for t in tokens).most_common(1)[0][0]
    tok = copy.deepcopy(tokenizer)
    tok.eos_token = tok.convert_ids_to_tokens(common)
    assert tok.eos_token_id == common
    return tok


def play(model, tok, prompts, env="episode_envs:Scripted", n=2, greedy=False, **kw):
    params = EpisodeParams(env, **({"max_turns": 4, "max_turn_tokens": 24,
                                    "max_episode_tokens": 120} | kw))
    return run_episodes(HFBackend.of_model(model, tok), prompts, n,
                        SamplingParams(24, greedy=greedy, seed=5), params)


def runs(mask: list[int]) -> list[tuple[int, int, int]]:
    """(value, start, end) of each run of equal values."""
    out, start = [], 0
    for i in range(1, len(mask) + 1):
        if i == len(mask) or mask[i] != mask[start]:
            out.append((mask[start], start, i))
            start = i
    return out


def test_trajectory_is_generated_ids_then_observation_ids_in_order(model64, turn_tokenizer,
                                                                   make_prompts):
    LOG.clear()
    table, stats = play(model64, turn_tokenizer, make_prompts(TEXTS))
    assert stats.turns > len(table)  # several episodes ran more than one turn
    rows = table.to_pylist()
    multi = 0
    for row in rows:
        ids, mask, lps = row["response_ids"], row["loss_mask"], row["logprobs"]
        log = LOG[f"{row['prompt_id']}#{row['sample_idx']}"]
        gen = [ids[a:b] for v, a, b in runs(mask) if v == 1]
        obs = [ids[a:b] for v, a, b in runs(mask) if v == 0]
        # each generated run is one turn, ending at EOS, and decodes to what the env read
        stepped = gen[:len(log["turns"])]
        assert [turn_tokenizer.decode(g, skip_special_tokens=True) for g in stepped] \
            == log["turns"]
        assert all(g[-1] == turn_tokenizer.eos_token_id for g in stepped)
        # each observation run is the observation as tokenized, appended in order
        expected = [turn_tokenizer(o, add_special_tokens=False)["input_ids"]
                    for o in log["observations"]]
        assert obs == expected[:len(obs)]
        assert ids == [t for pair in zip(gen, obs + [[]] * (len(gen) - len(obs)))
                       for part in pair for t in part]
        assert all(lp == 0.0 for lp, m in zip(lps, mask) if m == 0)
        multi += len(gen) > 1
    assert multi >= 2
    # behaviour logprobs are the model's on exactly these ids in this context (teacher
    # forcing over prompt + whole trajectory): nothing was re-tokenized or lost
    prompts = table.column("prompt_ids").to_pylist()
    responses = table.column("response_ids").to_pylist()
    with torch.no_grad():
        logp, real = response_logprobs(model64, prompts, responses, turn_tokenizer.pad_token_id,
                                       1.0)
    for i, row in enumerate(rows):
        gen_pos = [j for j, m in enumerate(row["loss_mask"]) if m]
        torch.testing.assert_close(logp[i, gen_pos].float(),
                                   torch.tensor(row["logprobs"])[gen_pos], atol=1e-5, rtol=0)
    scored = score_episodes(table)
    assert scored.column("reward").to_pylist() == table.column("env_reward").to_pylist()


def test_each_round_is_a_prefill_decode_and_an_env_wait(model64, turn_tokenizer,
                                                        make_prompts):
    got: list[tuple] = []
    phases.set_sink(lambda *phase: got.append(phase))
    try:
        _, stats = play(model64, turn_tokenizer, make_prompts(TEXTS))
    finally:
        phases.set_sink(None)
    waits = [(t1 - t0, args) for name, t0, t1, args in got if name == "env_wait"]
    assert 1 <= len(waits) <= 4 and {"prefill", "decode"} == {n for n, *_ in got} - {"env_wait"}
    assert sum(s for s, _ in waits) == pytest.approx(stats.env_wait_seconds, abs=1e-3)
    assert all(1 <= args["episodes"] <= 2 * len(TEXTS) for _, args in waits)  # those stepped
    prefilled = [args for name, _, _, args in got if name == "prefill"]  # one per round
    assert len(waits) <= len(prefilled) <= 4 and sum(a["requests"] for a in prefilled) == \
        stats.turns


def test_kv_kept_across_turns_equals_reprefill(model64, turn_tokenizer, make_prompts):
    prompts = make_prompts(TEXTS)
    kept, s_kept = play(model64, turn_tokenizer, prompts, n=1, greedy=True)
    again, s_again = play(model64, turn_tokenizer, prompts, n=1, greedy=True, keep_kv=False)
    assert kept.column("response_ids").to_pylist() == again.column("response_ids").to_pylist()
    assert max(kept.column("turns").to_pylist()) > 1
    assert s_kept.turns == s_again.turns


def test_limits_end_episodes(model64, turn_tokenizer, make_prompts):
    table, _ = play(model64, turn_tokenizer, make_prompts(TEXTS), max_turns=1)
    assert set(table.column("turns").to_pylist()) == {1}
    assert set(table.column("finish_reason").to_pylist()) <= {"turns", "length"}
    table, _ = play(model64, turn_tokenizer, make_prompts(TEXTS), max_episode_tokens=12)
    assert all(len(r) <= 12 for r in table.column("response_ids").to_pylist())
    assert "length" in table.column("finish_reason").to_pylist()


def test_failing_environments_end_only_their_episode(model64, turn_tokenizer, make_prompts):
    LOG.clear()  # a prompt whose first greedy turn ends at EOS, so its environment steps
    play(model64, turn_tokenizer, make_prompts(TEXTS), n=1, greedy=True)
    stepping = [TEXTS[int(k[1:].split("#")[0])] for k, v in sorted(LOG.items()) if v["turns"]]
    faults = ["raise", "hang", "garbage", "fine", "bad-reset"]
    prompts = make_prompts([stepping[0]] * len(faults), answers=faults)
    table, stats = play(model64, turn_tokenizer, prompts, env="episode_envs:Faulty", n=1,
                        greedy=True, step_timeout_s=1.0)
    rows = {r["answer"]: r for r in table.to_pylist()}
    assert "RuntimeError: the environment broke" in rows["raise"]["env_error"]
    assert "timeout" in rows["hang"]["env_error"]
    assert "step returned dict" in rows["garbage"]["env_error"]
    assert "reset returned int" in rows["bad-reset"]["env_error"]
    for fault in ("raise", "hang", "garbage", "bad-reset"):
        assert rows[fault]["finish_reason"] == "error"
    assert rows["fine"]["env_error"] is None and rows["fine"]["finish_reason"] != "error"
    assert stats.env_errors == 4 and stats.env_seconds >= 1.0


def test_observation_tokens_take_no_part_in_the_loss(model, turn_tokenizer, make_prompts):
    """Scaling the observation tokens' behaviour logprobs changes neither the loss (policy
    gradient and KL) nor the gradient; scaling the generated ones' does."""
    table, _ = play(model, turn_tokenizer, make_prompts(TEXTS))
    masks = table.column("loss_mask").to_pylist()
    assert any(0 in m for m in masks)
    n = len(table)
    trainable = table.append_column("reward", pa.array([0.0] * n, pa.float64())) \
        .append_column("reward_error", pa.array([None] * n, pa.string())) \
        .append_column("advantage", pa.array([1.0, -1.0] * (n // 2), pa.float32()))

    ref = copy.deepcopy(model)  # a reference that differs, so the KL term is not zero
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(0.01 * torch.randn(p.shape, generator=torch.Generator().manual_seed(1)))

    kl_of: list[float] = []

    def loss_and_grad(logprobs):
        net = copy.deepcopy(model)
        t = trainable.set_column(trainable.column_names.index("logprobs"), "logprobs",
                                 pa.array(logprobs, pa.list_(pa.float32())))
        opt = torch.optim.SGD(net.parameters(), lr=0.0)
        out = update_policy(net, opt, t, UpdateParams(kl_coef=0.1),
                            turn_tokenizer.pad_token_id, ref_model=ref)
        assert out["kl"] > 0 and out["tokens"] == sum(map(sum, masks))
        kl_of.append(out["kl"])
        return out["loss"], torch.cat([p.grad.flatten() for p in net.parameters()])

    base = table.column("logprobs").to_pylist()
    pairs = list(zip(base, masks))
    obs_scaled = [[lp if m else lp * 7.0 - 3.0 for lp, m in zip(r, ms)] for r, ms in pairs]
    gen_scaled = [[lp * 1.5 if m else lp for lp, m in zip(r, ms)] for r, ms in pairs]
    loss0, grad0 = loss_and_grad(base)
    # the KL term is the mean over generated tokens only
    args = (table.column("prompt_ids").to_pylist(), table.column("response_ids").to_pylist(),
            turn_tokenizer.pad_token_id, 1.0)
    with torch.no_grad():
        logp, real = response_logprobs(model, *args)
        delta = response_logprobs(ref, *args)[0] - logp
    gen = real & torch.nn.utils.rnn.pad_sequence(
        [torch.tensor(m, dtype=torch.bool) for m in masks], batch_first=True)
    kl = torch.exp(delta) - delta - 1
    assert kl_of[0] == pytest.approx((kl[gen].sum() / gen.sum()).item(), rel=1e-4)
    assert kl_of[0] != pytest.approx((kl[real].sum() / real.sum()).item(), rel=1e-4)
    loss1, grad1 = loss_and_grad(obs_scaled)
    loss2, _ = loss_and_grad(gen_scaled)
    assert loss1 == pytest.approx(loss0, abs=1e-7)
    torch.testing.assert_close(grad1, grad0)
    assert loss2 != pytest.approx(loss0, abs=1e-4)

