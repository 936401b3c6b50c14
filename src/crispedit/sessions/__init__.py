"""Sequential editing: one round at a time on the edited model (:mod:`.sequential`: CrispEdit-Seq and the
baselines' sequential modes, in memory), durable sessions that survive crashes (:mod:`.session`) and their
directory's JSON files, read without torch (:mod:`.files`). Importing the package imports none of them."""
