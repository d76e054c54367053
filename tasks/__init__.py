"""What the model is asked and how its answers are checked.

- `verify.py`: answer checking (extraction, normalisation, equivalence), under eq. 7's reward.
- `countdown.py`: the Countdown task and its reward.
- `episodes.py`: tasks in turns (`next_turn`, `play`, the memory task).
- `tools.py`: a calculator and Python, called inside an episode (`--tools`).
"""
