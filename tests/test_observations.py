"""The one missing-observation rule (pyro_smc.observations) that every engine reads."""

import math

import pytest
import torch

from pyro_smc.observations import check_observations, inf_error, row_status, step_observation

NAN = math.nan


def test_check_observations_applies_the_missing_data_rule():
    like = torch.zeros(1, dtype=torch.float32)
    ys, observed = check_observations([torch.tensor([1.0, float("nan")]), None], 2)
    assert ys.dtype == torch.float64 and observed.tolist() == [[True, False], [False, False]]
    ys, observed = check_observations([None, None], 2, like=like)
    assert ys.dtype == torch.float32 and not observed.any()
    # The model's dtype is the data's: float64 data for a float32 model is an error saying so.
    with pytest.raises(ValueError, match=r"observations have dtype torch.float64.*torch.float32.*\.to\("):
        check_observations([torch.tensor([1.0, float("nan")]), None], 2, like=like)
    # Integer data: convert it; building the model in torch.int64 is no advice.
    with pytest.raises(ValueError, match=r"torch.int64.*\.to\(torch.float32\)[^,]*$") as error:
        check_observations(torch.zeros(3, 2, dtype=torch.long), 2, like=like)
    assert "build the model" not in str(error.value)
    with pytest.raises(ValueError, match="at least one time step"):
        check_observations([], 2, like=like)
    with pytest.raises(ValueError, match="time step 1"):
        check_observations(torch.tensor([[0.0], [float("inf")]]), 1)
    with pytest.raises(ValueError, match=r"observations\[1\]"):
        check_observations([torch.zeros(2), torch.zeros(3)], 2)
    with pytest.raises(ValueError, match="shape"):
        check_observations(torch.zeros(4, 3), 2)


def test_row_status_marks_missing_partly_missing_and_padded_rows():
    flat = torch.tensor([[[0.5, 1.0], [NAN, NAN], [NAN, 2.0], [9.0, 9.0]]])  # (B=1, T=4, k=2)
    status = row_status(flat, padded=torch.tensor([[False, False, False, True]]))
    assert status.missing.tolist() == [[False, True, False, True]]
    assert status.partly.tolist() == [[False, False, True, False]]
    assert status.nan[0, 2].tolist() == [True, False] and not status.nan[0, 3].any()


def test_row_status_names_the_first_infinite_step_and_sequence_but_skips_padding():
    flat = torch.zeros(2, 3, 1)
    flat[1, 2, 0] = math.inf
    with pytest.raises(ValueError, match=r"time step 2 \(sequence 1\) contains inf"):
        row_status(flat)
    padded = torch.tensor([[False, False, False], [False, False, True]])
    assert not row_status(flat, padded).partly.any()  # an inf in padding is never read
    with pytest.raises(ValueError, match=r"^observation at time step 4 contains inf"):
        row_status(torch.tensor([[0.0]] * 4 + [[-math.inf]]))


def test_step_observation_applies_the_rule_to_one_step():
    assert step_observation(None, 0) == (True, None)
    assert step_observation(torch.full((3,), NAN), 1).missing
    partly = step_observation(torch.tensor([NAN, 1.0]), 2)
    assert not partly.missing and partly.observed.tolist() == [False, True]
    assert step_observation(torch.tensor([1, 2]), 3) == (False, None)  # integer data is never missing
    assert step_observation(torch.zeros(0), 4) == (False, None)  # nothing to miss
    with pytest.raises(ValueError, match="time step 5 contains inf"):
        step_observation(torch.tensor([math.inf, 0.0]), 5)
    with pytest.raises(ValueError, match="time step 6 has shape"):
        step_observation(torch.zeros(3), 6, expected_shape=torch.Size([2]))
    with pytest.raises(ValueError, match="time step 7 must be a Tensor or None, got list"):
        step_observation([1.0], 7)


def test_every_inf_message_is_the_same():
    messages = set()
    for raise_it in (
        lambda: row_status(torch.tensor([[math.inf]])),
        lambda: step_observation(torch.tensor([math.inf]), 0),
        lambda: check_observations(torch.tensor([[math.inf]]), 1),
    ):
        with pytest.raises(ValueError) as error:
            raise_it()
        messages.add(str(error.value))
    assert messages == {str(inf_error(0))}
