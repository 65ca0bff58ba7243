"""EndpointPickerConfig: model, loader, defaults, plugin registry."""
