"""What is fitted after training, on top of a finished run: temperature scaling
(`temperature`)."""
