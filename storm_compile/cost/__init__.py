"""What a step costs: device profiles and their calibration, the cost model, the simulator, and
where copies go on its timeline."""
