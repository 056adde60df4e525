"""How a prediction is scored: classification metrics (error, NLL, Brier, calibration;
`classification`, `calibration`), segmentation metrics (mIoU, global accuracy, pixel calibration;
`segmentation`), selective prediction (`selective`), conformal prediction sets and their coverage
(`conformal`), the entropy decomposition of an ensemble
(`uncertainty`), OpenOOD's post-hoc out-of-distribution scores (`ood_scores`) and the metrics of
every smaller ensemble from one set of members (`ablation`)."""
