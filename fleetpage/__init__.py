"""The fleet page: a read-only web view of the nodes a controller holds, served on the controller's
HTTP listener (``page.install``). Its HTML, CSS and script are the files under ``assets/``, shipped
as package data and loaded once (``assets``)."""
