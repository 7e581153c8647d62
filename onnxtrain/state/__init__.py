"""Training state: the bindings of TrainingInfoProtos and the variables they name."""
