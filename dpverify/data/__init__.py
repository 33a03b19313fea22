"""The data path and evaluation metrics against one device: which samples the ranks' loaders
deliver each epoch (``path``), what a distributed or DataParallel evaluation reports
(``metrics``), how a loader is read (``samples``) and the usual loader constructions
(``loaders``)."""
