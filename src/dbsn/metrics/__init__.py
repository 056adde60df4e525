"""What a prediction is measured by: classification metrics (error, NLL, Brier, calibration;
`classification`, `calibration`), segmentation metrics (mIoU, global accuracy, pixel calibration;
`segmentation`), selective prediction (`selective`), the entropy decomposition of an ensemble
(`uncertainty`) and the metrics of every smaller ensemble from one set of members (`ablation`)."""
