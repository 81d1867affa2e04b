"""What a training step would hold, predicted without allocating: the fake-tensor step, `predict`,
`predict_fits` and the closed form."""
