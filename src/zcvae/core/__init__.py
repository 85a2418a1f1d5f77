"""Pure tensor math of the objective: the six reconstruction terms, the latent KL and auxiliaries, J."""
