"""What a prediction is measured by: classification metrics (error, NLL, Brier, calibration;
`classification`) and segmentation metrics (mIoU, global accuracy, pixel calibration;
`segmentation`)."""
