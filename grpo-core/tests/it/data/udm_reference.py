"""Reference values of grpo-core's UDM classifier (tests/it/udm.rs): scikit-learn's
LogisticRegression(class_weight="balanced"), as TRL's BCOTrainer fits it, on deterministic
embeddings: in float64 solved to the optimum, and in float32 with the defaults as TRL calls it.
Run: python3 udm_reference.py (numpy, scikit-learn)."""
import math

import numpy as np
from sklearn.linear_model import LogisticRegression


def embeddings():
    xs, ys = [], []
    for i in range(13):
        label = i % 3 != 0  # 8 desirable, 5 undesirable: the class weights differ
        shift = 0.3 if label else -0.2
        xs.append([math.sin(i * 1.3 + j * 0.7) + shift * math.cos(j) for j in range(4)])
        ys.append(1 if label else 0)
    return np.array(xs, dtype=np.float32), np.array(ys)


x, y = embeddings()
probe = np.array([[0.5, -0.25, 1.0, 0.0], [-1.0, 0.3, -0.2, 0.8]], dtype=np.float32)
# OPTIMUM: float64 embeddings solved to the optimum; TRL: float32 embeddings and the defaults,
# as TRL's BCOTrainer calls it (scikit-learn then solves in float32).
for name, xx, kw in [
    ("OPTIMUM", x.astype(np.float64), dict(tol=1e-12, max_iter=100000)),
    ("TRL", x, {}),
]:
    c = LogisticRegression(class_weight="balanced", **kw).fit(xx, y)
    print(f"const {name}_COEF: [f64; 4] = [{', '.join('%.10f' % v for v in c.coef_[0])}];")
    print(f"const {name}_INTERCEPT: f64 = {c.intercept_[0]:.10f};")
    print(f"const {name}_PROBE: [f64; 2] = [{', '.join('%.10f' % v for v in c.predict_proba(probe)[:, 1])}];")
