"""Curvature of the capability loss and what is built from it: K-FAC factors (:mod:`.kfac`), EK-FAC
(:mod:`.ekfac`), the exact Gauss-Newton of small models (:mod:`.exact`), the factors' eigenbases
(:mod:`.eigen`), the on-disk cache (:mod:`.cache`), the drift a weight change is predicted to cause
(:mod:`.predicted`) and the low-curvature projectors the editors apply to gradients (:mod:`.projection`).
Importing the package imports none of them."""
