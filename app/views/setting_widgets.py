"""A control for a declared setting: a field's range, step, unit, special value and help (``engine.facts.fields``) make
its spin box or check box, so the Controls panel, every lesson's form, the CLI and the settings file agree by
construction. Model-dependent limits (top-k's vocabulary, max tokens' context) narrow the range later
(``narrow``); they never widen it past the declaration."""

from __future__ import annotations

from PySide6.QtWidgets import QCheckBox, QComboBox, QDoubleSpinBox, QSpinBox, QWidget

from engine.facts.validation import FieldShape

INT_LIMIT = 2**31 - 1               # what a spin box holds


def int_range(shape: FieldShape) -> tuple[int, int]:
    low, high = (int(shape.span.low), int(shape.span.high)) if shape.span else (0, INT_LIMIT)
    return low, min(high, INT_LIMIT)


def control(shape: FieldShape, optional_text: str = "") -> QWidget:
    """The widget for ``shape``, set to its default. ``optional_text``: for an int field that may be None, the
    words shown for None (one below the lowest value), e.g. "the model's whole context"."""
    setting = shape.setting
    default = shape.default
    if shape.base is bool:
        box = QCheckBox(setting.label if setting else shape.name)
        box.setChecked(bool(default))
    elif shape.base is int:
        box = QSpinBox()
        low, high = int_range(shape)
        if optional_text:
            box.setRange(low - 1, high)
            box.setSpecialValueText(optional_text)
            box.setValue(low - 1 if default is None else int(default))
        else:
            box.setRange(low, high)
            box.setValue(low if default is None else int(default))
        if setting is not None and setting.step:
            box.setSingleStep(max(int(setting.step), 1))
    elif shape.base is float:
        box = QDoubleSpinBox()
        step = setting.step if setting is not None and setting.step else 0.25
        box.setDecimals(2 if step >= 0.01 else 4)
        box.setRange(shape.span.low, shape.span.high)
        box.setSingleStep(step)
        box.setValue(float(default))
    else:
        raise TypeError(f"no control for {shape.name} ({shape.base.__name__})")
    if setting is not None:
        if shape.base is not bool:
            if setting.unit:
                box.setSuffix(f" {setting.unit}")
            if setting.special and not optional_text:
                box.setSpecialValueText(setting.special)
        box.setToolTip(setting.help[:1].upper() + setting.help[1:])
    return box


def narrow(box: QSpinBox | QDoubleSpinBox, shape: FieldShape, high: float | None) -> None:
    """The control's range: the declared one, capped at ``high`` (a limit the loaded model sets), never below
    the declared lowest value."""
    declared_high = int_range(shape)[1] if shape.base is int else shape.span.high
    top = declared_high if high is None else max(min(high, declared_high), shape.span.low)
    box.setMaximum(int(top) if shape.base is int else float(top))


def setting_text(shape: FieldShape, value: object, short: bool = False) -> str:
    """A setting and its value in words, as a status line says it ("new tokens 96 tokens" is said "new tokens
    96"): the label, the value, the unit unless the label already names it. ``short``: as a lecture footer says
    it beside its key, the key's short word (``Key.short``) instead of the label ("top-k 40", "48 tokens")."""
    setting = shape.setting
    label = setting.label if setting is not None else shape.name.replace("_", " ")
    if short and shape.key is not None:
        label = shape.key.short
    if value is None:
        shown = setting.none if setting is not None and setting.none else "the default"
    elif setting is not None and setting.special and shape.span is not None and value == shape.span.low:
        shown = setting.special
    elif isinstance(value, float):
        shown = f"{value:g}"
    elif isinstance(value, int) and not isinstance(value, bool):
        shown = f"{value:,}"
    else:
        shown = str(value)
    unit = setting.unit if setting is not None and setting.unit and setting.unit not in label.lower() else ""
    return f"{label.lower()} {shown}{' ' + unit if unit and shown[:1].isdigit() else ''}".strip()


def read(widget: QWidget) -> object:
    """A setting's value as its control holds it (a float to four places, as the engine is given it)."""
    if isinstance(widget, QCheckBox):
        return widget.isChecked()
    if isinstance(widget, QComboBox):
        return widget.currentText().strip()
    if isinstance(widget, QDoubleSpinBox):
        return round(widget.value(), 4)
    return widget.value()


def show(widget: QWidget, value: object) -> None:
    """Set a control to ``value`` without it writing back."""
    if read(widget) == value:
        return
    widget.blockSignals(True)
    if isinstance(widget, QCheckBox):
        widget.setChecked(bool(value))
    elif isinstance(widget, QComboBox):
        widget.setCurrentText(str(value))
    else:
        widget.setValue(value)
    widget.blockSignals(False)
