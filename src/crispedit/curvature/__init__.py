"""Curvature of the capability loss and what is built from it: one interface for every curvature model
(:mod:`.base`), K-FAC factors and the layer-input covariance that implement it (:mod:`.factors`), their collection
(:mod:`.kfac`), the factors' eigenbases (:mod:`.eigen`), the on-disk cache (:mod:`.cache`), the drift a weight
change is predicted to cause (:mod:`.predicted`) and the low-curvature projectors the editors apply to gradients
(:mod:`.projection`). Importing the package imports none of them."""
