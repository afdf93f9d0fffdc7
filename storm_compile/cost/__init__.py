"""What a step costs: device profiles and their calibration, the cost model, the simulator and what it predicts, and where copies go on its timeline."""
