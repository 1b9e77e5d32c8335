"""Which arm of a step A/B (`step_ab.py`'s JSON) to keep: the first arm (the current default) unless another's mean
of its rounds' medians is lower by more than MARGIN us (the rounds' spread inside one arm is 2-8 us).

    python experiments/step_folds/pick.py OUT/<fold>_step_ab.json [MARGIN]   -> prints the arm's name
"""
import json
import sys


def pick(path: str, margin: float = 3.0) -> str:
    times = json.load(open(path))["times"]
    mean = {arm: sum(r["median_us"] for r in rounds) / len(rounds) for arm, rounds in times.items()}
    first = next(iter(mean))
    best = min(mean, key=mean.get)
    return best if mean[best] < mean[first] - margin else first


if __name__ == "__main__":
    print(pick(sys.argv[1], float(sys.argv[2]) if len(sys.argv) > 2 else 3.0))
