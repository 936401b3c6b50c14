"""Studies built on whole edit jobs: ``compare`` (several methods on the same edits, one table and a
Pareto figure: :mod:`.compare`) and the MNIST → Fashion-MNIST curvature study (:mod:`.mnist_study`, its
torch-free settings in :mod:`.mnist_config`, its curvature models and projectors in :mod:`.study_curvature`, with
EK-FAC in :mod:`.ekfac` and the exact Gauss-Newton and Hessian in :mod:`.exact_curvature`). Importing the package
imports none of them."""
