"""backend/training/ppo_math.py against values worked out by hand (the arithmetic in each test's comments)."""
from __future__ import annotations

import math

import pytest
import torch

from backend.training import ppo_math as P


def t(rows):
    return torch.tensor(rows, dtype=torch.float32)


def test_token_rewards_put_the_score_on_the_last_response_token():
    # kl = logp - ref = [0.5, 0, -1]; reward = -0.1 x kl, + the score 1.0 on the last token: [-0.05, 0, 0.1 + 1]
    rewards, kl = P.token_rewards(t([1.0]), t([[-1, -2, -3]]), t([[-1.5, -2, -2]]), t([[1, 1, 1]]), kl_coef=0.1)
    assert rewards.tolist()[0] == pytest.approx([-0.05, 0.0, 1.1])
    assert kl.tolist()[0] == pytest.approx([0.5, 0.0, -1.0])
    # a response of two tokens: the score goes on its second, the padding gets nothing
    rewards, _ = P.token_rewards(t([1.0]), t([[-1, -2, -3]]), t([[-1.5, -2, -2]]), t([[1, 1, 0]]), kl_coef=0.1)
    assert rewards.tolist()[0] == pytest.approx([-0.05, 1.0, 0.0])


def test_gae_by_hand():
    # gamma 0.9, lam 0.5, V = 0.5 everywhere, reward 1 on the last token:
    # t2: delta = 1 + 0 - 0.5 = 0.5 -> A2 = 0.5
    # t1: delta = 0 + 0.9 x 0.5 - 0.5 = -0.05 -> A1 = -0.05 + 0.45 x 0.5 = 0.175
    # t0: delta = -0.05 -> A0 = -0.05 + 0.45 x 0.175 = 0.02875;  returns = A + V
    adv, ret = P.gae(t([[0, 0, 1]]), t([[0.5, 0.5, 0.5]]), t([[1, 1, 1]]), gamma=0.9, lam=0.5)
    assert adv.tolist()[0] == pytest.approx([0.02875, 0.175, 0.5])
    assert ret.tolist()[0] == pytest.approx([0.52875, 0.675, 1.0])
    # padding after the response: its value (9) is not bootstrapped from, its advantage is 0
    # t1: delta = 2 + 0 - 1 = 1 -> A1 = 1;  t0: delta = 0 + 0.9 x 1 - 0.5 = 0.4 -> A0 = 0.4 + 0.45 x 1 = 0.85
    adv, ret = P.gae(t([[0, 2, 0]]), t([[0.5, 1.0, 9.0]]), t([[1, 1, 0]]), gamma=0.9, lam=0.5)
    assert adv.tolist()[0] == pytest.approx([0.85, 1.0, 0.0])
    assert ret.tolist()[0] == pytest.approx([1.35, 2.0, 0.0])
    # gamma = lam = 1: the advantage is the sum of the rewards to come minus the value
    adv, _ = P.gae(t([[1, 2, 3]]), t([[0, 0, 0]]), t([[1, 1, 1]]), gamma=1.0, lam=1.0)
    assert adv.tolist()[0] == pytest.approx([6, 5, 3])


def test_clipped_policy_loss_by_hand():
    # ratios 1.5, 0.5, 1.0 with advantages 1, -1, 2 and cliprange 0.2:
    # token 1: max(-1.5, -1.2) = -1.2 (clipped);  token 2: max(0.5, 0.8) = 0.8 (clipped);  token 3: -2
    old = t([[0.0, 0.0, 0.0]])
    new = t([[math.log(1.5), math.log(0.5), 0.0]])
    loss, stats = P.policy_loss(new, old, t([[1, -1, 2]]), t([[1, 1, 1]]), cliprange=0.2)
    assert loss.item() == pytest.approx((-1.2 + 0.8 - 2) / 3)
    assert stats["clip_fraction"] == pytest.approx(2 / 3)
    assert stats["approx_kl"] == pytest.approx(0.5 * (math.log(1.5) ** 2 + math.log(0.5) ** 2) / 3)
    # a wider cliprange clips nothing here: the plain surrogate (-1.5 + 0.5 - 2) / 3
    loss, stats = P.policy_loss(new, old, t([[1, -1, 2]]), t([[1, 1, 1]]), cliprange=0.6)
    assert loss.item() == pytest.approx(-1.0) and stats["clip_fraction"] == 0


def test_clipped_value_loss_by_hand():
    # old values 0.5, new 1.0 and 0.0, returns 2 and 0, cliprange_value 0.2 -> clipped values 0.7 and 0.3:
    # token 1: max((1 - 2)^2, (0.7 - 2)^2) = 1.69;  token 2: max(0, 0.09) = 0.09;  loss = 0.5 x mean = 0.445
    loss, stats = P.value_loss(t([[1.0, 0.0]]), t([[0.5, 0.5]]), t([[2.0, 0.0]]), t([[1, 1]]), cliprange_value=0.2)
    assert loss.item() == pytest.approx(0.445)
    assert stats["value_clip_fraction"] == 1.0
    # wide enough not to clip: 0.5 x ((1 - 2)^2 + 0) / 2
    loss, _ = P.value_loss(t([[1.0, 0.0]]), t([[0.5, 0.5]]), t([[2.0, 0.0]]), t([[1, 1]]), cliprange_value=1.0)
    assert loss.item() == pytest.approx(0.25)


def test_whiten_over_the_mask():
    # [1, 2, 3, 4]: mean 2.5, unbiased std sqrt(5/3) = 1.29099
    std = math.sqrt(5 / 3)
    out = P.whiten(t([[1, 2, 3, 4, 100]]), t([[1, 1, 1, 1, 0]]))
    assert out.tolist()[0] == pytest.approx([-1.5 / std, -0.5 / std, 0.5 / std, 1.5 / std, 0.0], abs=1e-5)
    kept = P.whiten(t([[1, 2, 3, 4]]), t([[1, 1, 1, 1]]), shift_mean=False)
    assert kept.tolist()[0] == pytest.approx([2.5 - 1.5 / std, 2.5 - 0.5 / std, 2.5 + 0.5 / std, 2.5 + 1.5 / std],
                                             abs=1e-5)


def test_kl_controller_adaptive_and_fixed():
    # KL twice the target: error clipped to +0.2 -> x (1 + 0.2 x 100 / 10000) = 1.002
    adaptive = P.KLController(0.2, target=6.0, horizon=10000)
    assert adaptive.update(12.0, n_steps=100) == pytest.approx(0.2 * 1.002)
    # half the target: error -0.5 clipped to -0.2 -> x 0.998
    assert adaptive.update(3.0, n_steps=100) == pytest.approx(0.2 * 1.002 * 0.998)
    # within 20%: proportional, 7.2 / 6 - 1 = 0.2;  5.4 / 6 - 1 = -0.1
    assert P.KLController(1.0, 6.0, 100).update(5.4, n_steps=10) == pytest.approx(1 - 0.1 * 10 / 100)
    fixed = P.KLController(0.2, target=None)
    assert fixed.update(100.0, n_steps=100) == 0.2


def test_running_moments_normalise_by_every_score_seen():
    moments = P.RunningMoments()
    out = moments.normalize(t([1, 2, 3]))  # mean 2, unbiased std 1
    assert out.tolist() == pytest.approx([-1, 0, 1], abs=1e-5)
    out = moments.normalize(t([4]))  # now [1, 2, 3, 4]: mean 2.5, std sqrt(5/3)
    assert moments.mean == pytest.approx(2.5) and moments.std == pytest.approx(math.sqrt(5 / 3))
    assert out.item() == pytest.approx(1.5 / math.sqrt(5 / 3))


def test_entropy_of_uniform_and_certain():
    logits = t([[[0.0, 0.0, 0.0, 0.0], [100.0, 0.0, 0.0, 0.0]]])
    assert P.entropy(logits).tolist()[0] == pytest.approx([math.log(4), 0.0], abs=1e-5)


def test_each_ppo_key_changes_the_update():
    """The spec keys reach the arithmetic the trainer runs (backend/stages/ppo.py: kl_controller,
    advantages_and_returns, ppo_loss): each, set to another value, changes what one rollout batch trains on."""
    from backend.core.spec import validate_spec
    from backend.stages.ppo import advantages_and_returns, kl_controller, ppo_loss

    def spec(**keys):
        return validate_spec({"stage": "ppo", "dataset": "identity", "reward_funcs": "json_valid", **keys},
                             check_files=False)

    torch.manual_seed(0)
    scores, values = t([1.0, -0.5, 2.0]), torch.randn(3, 4)
    logprobs, ref = -torch.rand(3, 4), -torch.rand(3, 4)
    mask = t([[1, 1, 1, 1], [1, 1, 0, 0], [1, 1, 1, 0]])

    def rollout(s, kl_coef=0.2, moments=None):
        return advantages_and_returns(s, scores, logprobs, ref, values, mask, kl_coef,
                                      moments or P.RunningMoments(0.0, 4.0, 10.0))

    adv, ret, _ = rollout(spec())
    for keys in ({"gamma": 0.5}, {"lam": 0.3}, {"ppo_whiten_rewards": True}, {"ppo_score_norm": True}):
        other_adv, other_ret, _ = rollout(spec(**keys))
        assert not torch.allclose(other_ret, ret), keys
    assert not torch.allclose(rollout(spec(), kl_coef=0.05)[1], ret)  # init_kl_coef is the kl_coef of step 1
    assert kl_controller(spec(init_kl_coef=0.05)).value == 0.05
    assert kl_controller(spec(adap_kl_ctrl=False)).update(50.0, 64) == 0.2  # fixed
    adaptive = kl_controller(spec()).update(50.0, 64)
    assert adaptive > 0.2 and kl_controller(spec(ppo_target=100.0)).update(50.0, 64) < 0.2  # towards the target

    new_logprobs, new_values = logprobs + 0.3 * torch.randn(3, 4), values + torch.randn(3, 4)
    loss, stats = ppo_loss(spec(), new_logprobs, logprobs, adv, new_values, values, ret, mask)
    assert set(stats) == {"policy_loss", "value_loss", "clip_fraction", "approx_kl", "value_clip_fraction"}
    assert loss.item() == pytest.approx(stats["policy_loss"] + 0.1 * stats["value_loss"])
    for keys in ({"cliprange": 0.05}, {"cliprange_value": 0.05}, {"vf_coef": 1.0}):
        assert ppo_loss(spec(**keys), new_logprobs, logprobs, adv, new_values, values, ret, mask)[0].item() \
            != pytest.approx(loss.item()), keys
